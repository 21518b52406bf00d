"""The plugin's hooks are one table (``sglang_ext.hooks.HOOKS``): each target once, a kind SGLang knows, and a
target that exists in the installed SGLang."""
import importlib

from sglang.srt.plugins.hook_registry import HookType

from sglang_ext.hooks import HOOKS


def _resolve(target: str):
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(target)


def test_each_target_once_with_a_known_kind():
    targets = [h.target for h in HOOKS]
    assert len(set(targets)) == len(targets)
    assert {h.kind for h in HOOKS} <= {k.value for k in HookType}
    assert all(h.why for h in HOOKS)


def test_every_target_exists_in_sglang():
    assert all(callable(_resolve(h.target)) for h in HOOKS)
