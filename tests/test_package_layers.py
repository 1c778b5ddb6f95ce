"""The layers: the speculation core never imports the training package (what makes weights) nor the apps (CLI, server,
benches, demo) built on it."""
import subprocess
import sys

APPS = ("drafttree.training", "drafttree.apps")
CHECKED_ONLY = ("drafttree.conformance",)  # mypy's file that checks every layer's classes against the protocols

# walks by hand: pkgutil.walk_packages would import the app packages it recurses into
IMPORT_THE_CORE = """
import importlib, pkgutil, sys, drafttree
apps, core = {apps!r}, []
skip = apps + {checked_only!r}
def walk(pkg):
    for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."):
        if not m.name.startswith(skip):
            core.append(m.name)
            module = importlib.import_module(m.name)
            if m.ispkg:
                walk(module)
walk(drafttree)
print(len(core), sorted(m for m in sys.modules if m.startswith(apps)))
"""


def test_the_core_imports_nothing_from_training_or_the_apps():
    code = IMPORT_THE_CORE.format(apps=APPS, checked_only=CHECKED_ONLY)
    count, imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                     check=True).stdout.split(maxsplit=1)
    assert int(count) > 40
    assert imported.strip() == "[]", f"core modules import training or app modules: {imported}"
