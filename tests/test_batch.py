"""Batches of internal messages (daemon/batch.py, messages.pack/unpack) over real ZeroMQ sockets."""
import pytest
import zmq

from mcpd.daemon import batch, messages
from mcpd.daemon.batch import Batch

SAMPLES = [messages.encode(messages.Final(1, None), b"header-1"),
           messages.encode(messages.Drain()),
           messages.encode(messages.Chunk(2), b"header-2", b"payload", b""),
           messages.encode(messages.Done([1, 2]))]


@pytest.fixture
def pipe():
    """A PUSH and the PULL it reaches, in-process, each holding at most one message in its pipe."""
    context = zmq.Context()
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    for sock in (push, pull):
        sock.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 1)
    pull.setsockopt(zmq.RCVHWM, 1)
    pull.bind("inproc://batch")
    push.connect("inproc://batch")
    yield push, pull
    context.destroy(linger=0)


def received(pull: zmq.Socket) -> list[list[bytes]]:
    found = []
    while pull.poll(0):
        found += messages.unpack(pull.recv_multipart())
    return found


def test_unpack_gives_back_what_pack_took_in_order_and_a_lone_message_is_itself():
    assert messages.unpack(messages.pack(SAMPLES)) == SAMPLES
    assert messages.unpack(SAMPLES[0]) == [SAMPLES[0]]
    message, payload = messages.decode(messages.unpack(messages.pack(SAMPLES))[2])
    assert message == messages.Chunk(2) and payload == [b"header-2", b"payload", b""]


def test_a_flush_sends_what_was_held_as_one_two_frame_message_and_a_lone_message_unwrapped(pipe):
    push, pull = pipe
    held = Batch(push.send_multipart)
    for frames in SAMPLES:
        held.add(frames)
    assert held.flush() and held.held == []
    raw = pull.recv_multipart()
    assert raw[0] == messages.BATCH_TAG and len(raw) == 2 and messages.unpack(raw) == SAMPLES   # frames cost: one for all
    held.add(SAMPLES[0])
    held.flush()
    assert pull.recv_multipart() == SAMPLES[0]


def test_a_full_pipe_keeps_the_rest_in_order_for_the_next_flush(pipe):
    push, pull = pipe
    held = Batch(lambda frames: push.send_multipart(frames, zmq.NOBLOCK))
    sent = [messages.encode(messages.Started(i)) for i in range(5 * batch.MAX_MESSAGES)]
    for frames in sent:
        held.add(frames)
    assert held.flush() is False and held.held   # the pipes hold two batches at most
    got = received(pull)
    while not held.flush():
        got += received(pull)
    got += received(pull)
    assert got == sent


def test_batches_stay_under_the_count_and_byte_caps():
    sizes = []
    held = Batch(lambda frames: sizes.append(len(messages.unpack(frames))))
    for i in range(batch.MAX_MESSAGES + 3):
        held.add(messages.encode(messages.Started(i)))
    held.flush()
    assert sizes == [batch.MAX_MESSAGES, 3]
    sizes.clear()
    big = messages.encode(messages.Final(1), bytes(batch.MAX_BYTES // 2 + 1))
    for _ in range(3):
        held.add(big)
    held.add(messages.encode(messages.Final(2), bytes(batch.MAX_BYTES + 1)))   # alone over the cap: goes alone
    held.flush()
    assert sizes == [1, 1, 1, 1]


def test_the_receiving_handlers_see_each_message_decoded_behind_its_routing_id():
    seen = []
    batch.each_message(lambda *typed: seen.append(typed))(messages.pack(SAMPLES[:2]))
    batch.each_message(lambda *typed: seen.append(typed))(SAMPLES[3])
    assert seen == [messages.decode(SAMPLES[0]), messages.decode(SAMPLES[1]), messages.decode(SAMPLES[3])]
    routed = []
    batch.each_routed_message(lambda *typed: routed.append(typed))([b"w0", *messages.pack(SAMPLES[2:])])
    assert routed == [(b"w0", *messages.decode(SAMPLES[2])), (b"w0", *messages.decode(SAMPLES[3]))]
