"""The CPU a worker runs on: its features (ISA), how many threads on which cores, and the tuner that
changes the thread count when a neighbour takes a core."""
