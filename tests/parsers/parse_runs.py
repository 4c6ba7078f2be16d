"""The streaming parser's test harness, shared by the parser test files: rebuild a message from
the deltas of a chunked feed, and from a whole-text parse (``(reasoning, content, [(name, args)])``).

Not a test module: the files beside it import it by name (``conftest.py`` puts this folder on ``sys.path``).
"""

from __future__ import annotations

from pagedllm.parsers import make_parser, parse_whole


def run_chunks(tp, rp, kw, chunks) -> tuple:
    """Feed ``chunks`` one by one and rebuild the message from the deltas alone."""
    p = make_parser(rp, tp, **kw)
    reasoning, content, calls = "", "", []
    for piece in list(chunks) + [None]:
        d = p.feed(piece) if piece is not None else p.finish()
        reasoning += d.reasoning_content
        content += d.content
        for tc in d.tool_calls:
            if tc.id is not None:
                assert tc.index == len(calls), "a new call must take the next index"
                assert tc.name, "the first delta of a call carries its name"
                calls.append([tc.id, tc.name, tc.arguments])
            else:
                assert tc.name is None
                calls[tc.index][2] += tc.arguments
    ids = [c[0] for c in calls]
    assert len(set(ids)) == len(ids), "tool call ids must be distinct"
    return reasoning or None, content or None, [(c[1], c[2]) for c in calls]


def whole(tp, rp, kw, text) -> tuple:
    m = parse_whole(text, rp, tp, **kw)
    return m.reasoning_content, m.content, [(c.name, c.arguments) for c in m.tool_calls]
