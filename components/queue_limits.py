"""A bound on the events one client may have waiting in gradio's queue. Gradio bounds only the total
(`queue(max_size=...)`); without this, one client could fill it and keep every other user waiting.

A client is its address: the first one in X-Forwarded-For where a proxy (a Space) sets it, else the peer's.
The check wraps the queue's `push` (the call behind /queue/join), so a refused event never enters the queue;
the client gets HTTP 503 with a one-line reason, as for a full queue.
"""
from __future__ import annotations

import gradio as gr


def client_of(request) -> str:
    """The client's address as the server sees it ("" when unknown)."""
    try:
        forwarded = request.headers.get("x-forwarded-for", "")
        return forwarded.split(",")[0].strip() or (request.client.host if request.client else "")
    except AttributeError:
        return ""


def waiting(queue, client: str) -> int:
    """Events of this client waiting in the queue (not yet running)."""
    return sum(client_of(e.request) == client for q in queue.event_queue_per_concurrency_id.values() for e in q.queue)


def limit_per_client(blocks: gr.Blocks, limit: int) -> None:
    """Refuse a new event from a client that already has `limit` events waiting. Call after blocks.queue()."""
    queue = blocks._queue
    push = queue.push

    async def limited_push(body, request, username):
        client = client_of(request)
        if client and waiting(queue, client) >= limit:
            return False, f"Too many requests waiting from this client (at most {limit}); wait for them to end.", \
                "queue_full"
        return await push(body=body, request=request, username=username)

    queue.push = limited_push
