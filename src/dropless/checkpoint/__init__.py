"""The on-disk format of a training step: write, read, the latest complete step, content hashes
and damage (`checkpoint.integrity`), layout conversion (`checkpoint.store`)."""
