"""``python -m extractive_lens.cli`` (and ``torchrun -m extractive_lens.cli``): the entry point."""

from extractive_lens.cli import main

main()
