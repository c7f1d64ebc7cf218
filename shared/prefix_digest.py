"""Digests of a request's prefix, computed alike by the coordinator (routing) and the workers
(publishing what each slot holds), so a submit can ask Redis which worker already holds it.

The coordinator has no tokenizer (a client or gateway host never loads llama.cpp), so the
digest is over the request's *canonical text*: a text prompt is its text, token ids are their
decimal ids, chat turns are role + JSON-escaped content per message (escaped content has no
newline, so the separators are unambiguous and a turn is a prefix of itself grown). A kind tag
leads, so a chat never matches a text prompt of the same letters (they tokenize differently).
The text is cut into fixed blocks of :data:`BLOCK_CHARS` characters and each block's digest
chains the previous one (``blake2b(prev || block)``, 8 bytes), as vLLM and Dynamo chain token
blocks: block *i*'s digest stands for the whole text up to the end of block *i*, so the number
of leading digests a worker holds is how deep the request's prefix is cached there.

A worker holds, per slot, the canonical text of the request it served *plus what it generated*
(:func:`continued`: an assistant turn for a chat, appended text or ids otherwise), so the next
turn of a conversation, or a continuation of a text, matches everything the slot computed.
This is a routing hint, never a correctness input: the engine compares tokens when it admits.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from hashlib import blake2b

from shared.protocol import GenerationRequest

#: Characters per digest block (~30 tokens of English text; ~25 token ids).
BLOCK_CHARS = 128
#: Blocks digested per request or slot (256 KiB of text: ``MAX_PROMPT_CHARS``); deeper
#: prefixes are rare and add nothing to the choice of a worker.
MAX_BLOCKS = 2048
_DIGEST_BYTES = 8
#: Field of a worker's published hash (``Keys.prefix_blocks``) counting its busy slots; the
#: others are block digests (hex, never this word).
BUSY_FIELD = "busy"


def canonical_text(request: GenerationRequest) -> str:
    """The text a request's prompt stands for (the prefix its blocks are cut from)."""
    if request.prompt_tokens is not None:
        return "tokens\n" + _ids(request.prompt_tokens)
    if request.messages is not None:
        return "chat\n" + "".join(_turn(m.role, m.text()) for m in request.messages)
    kind = "special" if request.parse_special else "text"
    return f"{kind}\n{request.prompt or ''}"


def continued(request: GenerationRequest, text: str, tokens: Sequence[int]) -> str:
    """The canonical text of ``request`` followed by its generation (``text``, ``tokens``):
    what a slot that served it holds, in the form the next request would send it."""
    base = canonical_text(request)
    if request.prompt_tokens is not None:
        return base + _ids(tokens)
    if request.messages is not None:
        return base + _turn("assistant", text)
    return base + text


def block_digests(text: str) -> list[str]:
    """Chained digests (hex) of every whole :data:`BLOCK_CHARS` block of ``text``, at most
    :data:`MAX_BLOCKS`; a trailing partial block has none (it may still grow)."""
    digests: list[str] = []
    previous = b""
    whole = min(len(text) // BLOCK_CHARS, MAX_BLOCKS)
    for i in range(whole):
        block = text[i * BLOCK_CHARS:(i + 1) * BLOCK_CHARS].encode("utf-8", "surrogatepass")
        previous = blake2b(previous + block, digest_size=_DIGEST_BYTES).digest()
        digests.append(previous.hex())
    return digests


def request_digests(request: GenerationRequest) -> list[str]:
    """The block digests of a request's prompt (what a submit looks for)."""
    return block_digests(canonical_text(request))


def leading_depth(found: Sequence[bool]) -> int:
    """How many leading blocks a worker holds, given membership of each digest in order
    (chaining makes a later hit after a miss a collision, never a deeper prefix)."""
    for depth, hit in enumerate(found):
        if not hit:
            return depth
    return len(found)


def _ids(tokens: Sequence[int]) -> str:
    return "".join(f"{t}," for t in tokens)


def _turn(role: str, content: str) -> str:
    return f"{role}\n{json.dumps(content, ensure_ascii=False)}\n"


__all__ = ["BLOCK_CHARS", "BUSY_FIELD", "MAX_BLOCKS", "block_digests", "canonical_text",
           "continued", "leading_depth", "request_digests"]
