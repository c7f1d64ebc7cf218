"""OpenAI's request and response shapes, translated to and from our protocol.

Below both the HTTP gateway (``coordinator.gateway``) and the batch store
(``coordinator.batch``): a batch line is read and answered exactly as the same request sent
over HTTP, and neither imports the other. Modules: ``fields`` (the one rule for every field:
honoured, accepted without effect, or refused by name), ``requests`` (completions and chat in),
``replies`` (completions and chat out, whole and streamed), ``responses`` (the Responses API).
"""
