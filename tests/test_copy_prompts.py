"""The "copy" prompt set: tasks over the Python standard library's own functions and docstrings."""
import pytest

from drafttree.datasets import PROMPT_SETS, load_prompts


def test_copy_prompt_set():
    prompts = load_prompts("copy")
    assert len(prompts) >= 30 and prompts == load_prompts("copy") and load_prompts("copy", 3) == prompts[:3]
    code = [p for p in prompts if "```python\ndef " in p]
    assert len(code) >= 20 and any("bug" in p for p in code) and any("type hints" in p for p in code)
    assert len(prompts) - len(code) >= 8  # quote / restate a docstring
    assert len(set(prompts)) == len(prompts)
    assert "copy" in PROMPT_SETS
    with pytest.raises(ValueError, match="copy"):
        load_prompts("nope")


