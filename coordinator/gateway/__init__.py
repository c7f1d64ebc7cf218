"""The OpenAI-compatible HTTP gateway (``specfleet serve``): a stateless front door.

Every request becomes a job through the coordinator's own submit path, and every response is
read back from the job's Redis Stream, so several gateways can serve one fleet behind a load
balancer and a gateway restart loses nothing. Modules, one job each: ``app`` (the ASGI app and
its wiring, CORS), ``routes`` (models, completions, chat, responses, health), ``streaming``
(SSE from jobs' streams), ``errors`` (OpenAI-shaped errors), ``auth`` (Bearer API keys and
the gateway's settings), ``batches`` (the files and batches endpoints over
``coordinator.batch``). The OpenAI shapes themselves are ``coordinator.openai_api``, below
this package and the batch store alike.
"""
