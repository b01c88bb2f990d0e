"""The Trainer strategies (``ddp``, ``fsdp``) and the parts every front end shares; Fabric's are in ``fabric``."""
