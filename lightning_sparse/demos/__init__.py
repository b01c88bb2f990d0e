"""Small, download-free training tasks: digits (an MLP), vision (a ResNet-18 on the digits at 32x32), text and GPT.
Digits and vision need ``pip install "lightning_sparse[examples]"``; text and GPT read Python's standard library."""

from lightning_sparse.demos.digits import DigitsClassifier, DigitsDataModule, accuracy, load_digits_tensors
from lightning_sparse.demos.gpt import GPTDataModule, TinyGPT, load_gpt_tensors, warmup_cosine
from lightning_sparse.demos.text import (
    TEXT_CHARS,
    TEXT_TRAIN_FILES,
    TEXT_VAL_FILES,
    TEXT_VOCAB,
    NextCharClassifier,
    TextDataModule,
    char_windows,
    encode_text,
    load_text_tensors,
    stdlib_source,
)
from lightning_sparse.demos.vision import DigitImagesDataModule, ResNetClassifier, load_digit_images

__all__ = [
    "load_digits_tensors",
    "DigitsDataModule",
    "DigitsClassifier",
    "accuracy",
    "TEXT_TRAIN_FILES",
    "TEXT_VAL_FILES",
    "TEXT_CHARS",
    "TEXT_VOCAB",
    "stdlib_source",
    "encode_text",
    "char_windows",
    "load_text_tensors",
    "TextDataModule",
    "NextCharClassifier",
    "load_gpt_tensors",
    "GPTDataModule",
    "warmup_cosine",
    "TinyGPT",
    "load_digit_images",
    "DigitImagesDataModule",
    "ResNetClassifier",
]
