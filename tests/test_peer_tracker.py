"""The front-end's map of clients to connections (peers.py), fed monitor reports and messages
in the orders libzmq may deliver them."""
from mcpd.daemon.frontend.peers import PeerTracker


def test_peer_tracker_ends_the_clients_of_the_connection_reported_closed():
    peers = PeerTracker()
    peers.accepted(5)
    assert peers.seen(b"\0a", 5) and peers.knows(b"\0a", 5)
    assert peers.disconnected(5) == [b"\0a"] and not peers.knows(b"\0a", 5)


def test_peer_tracker_a_silent_connections_close_is_not_the_next_clients():
    """The CI failure: fd 6 carried a connection that never spoke, then a client; the first's
    close was read after the client's message. Reports read first (as the front-end does)."""
    peers = PeerTracker()
    peers.accepted(6)            # silent
    assert peers.disconnected(6) == []
    peers.accepted(6)            # the client, on the reused descriptor
    assert peers.seen(b"\0c", 6)
    assert peers.disconnected(6) == [b"\0c"]


def test_peer_tracker_a_message_read_after_its_close():
    peers = PeerTracker()
    peers.accepted(7)
    assert peers.disconnected(7) == []
    assert not peers.seen(b"\0late", 7)                 # gone already: nobody reads a reply
    assert not peers.knows(b"\0late", 7)
    peers.accepted(7)
    assert peers.seen(b"\0next", 7)                     # the descriptor's next client is live


def test_peer_tracker_a_connection_libzmq_ended_unreported_ends_at_the_next_accept():
    peers = PeerTracker()
    peers.accepted(8)
    peers.seen(b"\0a", 8)
    assert peers.accepted(8) == [b"\0a"]


def test_peer_tracker_fixed_routing_ids_reconnect():
    peers = PeerTracker()
    peers.accepted(9)
    peers.seen(b"fixed", 9)
    assert not peers.knows(b"fixed", 9)                  # it may have come back on the same number
    peers.accepted(10)
    peers.seen(b"fixed", 10)                             # same routing id, new connection
    assert peers.disconnected(9) == [] and peers.disconnected(10) == [b"fixed"]
    peers.accepted(9)
    peers.seen(b"fixed", 9)
    assert peers.disconnected(9) == [b"fixed"]


def test_peer_tracker_ends_clients_in_the_order_they_came():
    peers = PeerTracker()
    peers.accepted(11)
    for name in (b"z", b"a", b"m"):
        peers.seen(name, 11)
    assert peers.disconnected(11) == [b"z", b"a", b"m"]
