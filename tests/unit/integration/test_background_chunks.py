"""The queue of missed chunks computed alone while the engine is idle (connector/background_chunks.py)."""

from ucm.integration.vllm.connector.background_chunks import BackgroundChunk, BackgroundChunks


def chunk(n: int) -> BackgroundChunk:
    return BackgroundChunk((n, n + 1, 2), f"key{n}".encode())


def test_each_chunk_is_queued_once_in_arrival_order():
    queue = BackgroundChunks()
    assert [queue.offer(chunk(1)), queue.offer(chunk(2)), queue.offer(chunk(1))] == [True, True, None]
    assert [queue.take(), queue.take(), queue.take()] == [chunk(1), chunk(2), None]
    assert queue.offer(chunk(1)) is True  # taken: it may be queued again (missed again later)


def test_a_full_queue_drops_new_chunks_and_a_stopped_chunk_goes_first():
    queue = BackgroundChunks(limit=2)
    assert [queue.offer(chunk(1)), queue.offer(chunk(2)), queue.offer(chunk(3))] == [True, True, False]
    stopped = queue.take()
    queue.offer(chunk(3))
    queue.put_back(stopped)  # past the limit: it was queued before the others
    assert len(queue) == 3 and [queue.take() for _ in range(3)] == [chunk(1), chunk(2), chunk(3)]
