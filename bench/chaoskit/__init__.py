"""The chaos run of bench/cluster.py: three real nodes on one real Redis, cluster-aware chat
clients, SIGKILLs of nodes and of Redis, and the figures of what the clients were promised."""
