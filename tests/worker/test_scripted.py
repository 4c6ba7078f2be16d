"""The scripted-output test hook: fixed tokens, then EOS, read once per step."""

from __future__ import annotations

from pagedllm.worker.scripted import ScriptedOutput


def test_script_then_eos_and_replaced_between_steps():
    s = ScriptedOutput([5, 6, 7])
    assert s.tokens([0, 2, 3, 9], eos=1) == [5, 7, 1, 1]
    s.set([8])
    assert s.tokens([0, 1], eos=2) == [8, 2]
    assert ScriptedOutput().tokens([0], eos=3) == [3]  # the default script ends every request at once
