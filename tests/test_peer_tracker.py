"""The front-end's map of clients to connections (peers.py), fed monitor reports and messages
in the orders libzmq may deliver them."""
from mcpd.daemon.frontend.peers import PeerTracker


def connected(peers: PeerTracker, fd: int, *identities: bytes) -> PeerTracker:
    """A connection accepted on fd, carrying these clients' messages."""
    peers.accepted(fd)
    assert all(peers.seen(identity, fd) for identity in identities)
    return peers


def test_peer_tracker_ends_the_clients_of_the_connection_reported_closed():
    peers = connected(PeerTracker(), 5, b"\0a")
    assert peers.knows(b"\0a", 5)
    assert peers.disconnected(5) == [b"\0a"] and not peers.knows(b"\0a", 5)


def test_peer_tracker_a_silent_connections_close_is_not_the_next_clients():
    """The CI failure: fd 6 carried a connection that never spoke, then a client; the first's
    close was read after the client's message. Reports read first (as the front-end does)."""
    peers = connected(PeerTracker(), 6)    # silent
    assert peers.disconnected(6) == []
    connected(peers, 6, b"\0c")            # the client, on the reused descriptor
    assert peers.disconnected(6) == [b"\0c"]


def test_peer_tracker_a_message_read_after_its_close():
    peers = connected(PeerTracker(), 7)
    assert peers.disconnected(7) == []
    assert not peers.seen(b"\0late", 7)    # gone already: nobody reads a reply
    assert not peers.knows(b"\0late", 7)
    connected(peers, 7, b"\0next")         # the descriptor's next client is live


def test_peer_tracker_a_connection_libzmq_ended_unreported_ends_at_the_next_accept():
    peers = connected(PeerTracker(), 8, b"\0a")
    assert peers.accepted(8) == [b"\0a"]


def test_peer_tracker_fixed_routing_ids_reconnect():
    peers = connected(PeerTracker(), 9, b"fixed")
    assert not peers.knows(b"fixed", 9)    # it may have come back on the same number
    connected(peers, 10, b"fixed")         # same routing id, new connection
    assert peers.disconnected(9) == [] and peers.disconnected(10) == [b"fixed"]
    connected(peers, 9, b"fixed")
    assert peers.disconnected(9) == [b"fixed"]


def test_peer_tracker_ends_clients_in_the_order_they_came():
    peers = connected(PeerTracker(), 11, b"z", b"a", b"m")
    assert peers.disconnected(11) == [b"z", b"a", b"m"]
