"""The way in: checks before torch is imported (preflight), the run directory and its lock, and the
launch of the engine in this process or in torchrun workers that read spec.yaml."""
