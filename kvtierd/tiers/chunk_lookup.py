"""Finding a prompt's chunks below the device: which tier holds each chunk that continues a chain, nearest
first, asking each tier as few times as a slow Redis's round trips make worth it."""

from __future__ import annotations

from collections.abc import Sequence

from kvtierd.tiers.backend import TierBackend
from kvtierd.tiers.chunk import ChunkSpan, FoundChunk


def find_chunks(tiers: Sequence[TierBackend], chunk_pages: int, block_size: int, namespace: bytes,
                block_hashes: Sequence[bytes], token_ids: Sequence[int], start: int) -> list[FoundChunk]:
    """The chunks `tiers` (nearest first) hold that continue a chain whose first `start` pages are on the
    device, in order.

    `block_hashes` are the hashes of the prompt's full pages from its chain's start, `token_ids` its tokens.
    The first chunk may begin before `start` (chunks are aligned): loading skips the pages the device has."""

    def span(begin: int, end: int) -> ChunkSpan:
        return ChunkSpan(namespace, begin, tuple(block_hashes[begin:end]),
                         tuple(token_ids[begin * block_size : end * block_size]))

    n, m = chunk_pages, len(block_hashes)
    first = start - start % n
    ends = range(first + n, m + 1, n)
    # A tier is asked once, when it is first needed (a slow Redis's delay once, not once per question):
    # whether it holds each whole chunk, and the partial last chunks the chain ends with when none or all of
    # the whole ones are found (where most lookups end); a tier is asked again only for a partial chunk past
    # a run that stopped midway.
    guesses = list(dict.fromkeys((*_partial_ends(first, m, start, n), *_partial_ends(ends[-1] if ends else first,
                                                                                    m, start, n))))
    answers: dict[int, tuple[list[bool], dict[int, bool]]] = {}  # tier -> (each whole chunk, partial end -> held)

    def answer(j: int) -> tuple[list[bool], dict[int, bool]]:
        if j not in answers:
            held = tiers[j].holds_each([block_hashes[e - 1] for e in (*ends, *guesses)])
            answers[j] = (held[: len(ends)], dict(zip(guesses, held[len(ends) :], strict=True)))
        return answers[j]

    found: list[FoundChunk] = []
    i = 0
    while i < len(ends):  # whole chunks: the longest run from i in the nearest tier that has chunk i
        for j, b in enumerate(tiers):
            whole = answer(j)[0]
            k = next((x for x, there in enumerate(whole[i:]) if not there), len(ends) - i)
            if k:
                found += [FoundChunk(b.tier, span(e - n, e)) for e in ends[i : i + k]]
                i += k
                break
        else:
            break
    pos = first + i * n
    # Then the chain's partial last chunk, if one was stored here: the longest first. Every length is asked
    # in one call per tier: a call per length cost a slow Redis's delay 15 times for each new prompt.
    partial_ends = _partial_ends(pos, m, start, n)
    if partial_ends:
        held = []
        for j, b in enumerate(tiers):
            guessed = answers[j][1] if j in answers else {}
            if all(end in guessed for end in partial_ends):
                held.append([guessed[end] for end in partial_ends])
            else:
                held.append(b.holds_each([block_hashes[end - 1] for end in partial_ends]))
        for j, end in enumerate(partial_ends):
            b = next((b for b, h in zip(tiers, held, strict=True) if h[j]), None)
            if b is not None:
                found.append(FoundChunk(b.tier, span(pos, end)))
                break
    return found


def _partial_ends(pos: int, num_pages: int, start: int, chunk_pages: int) -> range:
    """The ends of the partial chunks a chain found up to page `pos` may end with, the longest first (past the
    device's `start` pages)."""
    return range(min(pos + chunk_pages - 1, num_pages), max(pos, start), -1)
