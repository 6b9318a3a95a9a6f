"""Checkpoints: DCP save/resume on local, NFS or s3:// storage; Hugging Face import/export."""
