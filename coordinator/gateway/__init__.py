"""The OpenAI-compatible HTTP gateway (``specfleet serve``): a stateless front door.

Every request becomes a job through the coordinator's own submit path, and every response is
read back from the job's Redis Stream, so several gateways can serve one fleet behind a load
balancer and a gateway restart loses nothing. Modules, one job each: ``app`` (the ASGI app and
its wiring), ``routes`` (models, completions, chat, health), ``schemas`` (OpenAI shapes in and
out), ``streaming`` (SSE from a job's stream), ``errors`` (OpenAI-shaped errors), ``auth``
(Bearer API keys), ``batches`` (the files and batches endpoints over ``coordinator.batch``).
"""
