"""What bench/peers.py is built from: the shared checkpoint (checkpoints), the peers' set-up and
servers (servers), and the clients that talk to each system (clients). A package, not modules
beside the benchmarks, because `make bench` runs every bench/*.py as a benchmark."""
