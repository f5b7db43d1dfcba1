"""The kernels models run on: torch (the portable twin), native C on the CPU, Triton on CUDA, and
the choice between them (choice.py)."""
