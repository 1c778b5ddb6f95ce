"""The "copy" prompt set: tasks whose replies copy their prompt (rewrite / fix / extend a function, quote or
restate a passage), made from the source code and docstrings of Python's standard library as installed
(PSF licence), read with `inspect`, never executed. A fixed list, in a fixed order; a function whose source
this Python does not ship (frozen or C modules) is left out, so the set can differ between Python versions.
"""
from __future__ import annotations

import importlib
import inspect
import textwrap

# small pure-Python functions (module path, attribute path)
FUNCTIONS = (
    "string.capwords", "shlex.quote", "shlex.split", "textwrap.indent", "textwrap.shorten", "calendar.leapdays",
    "calendar.monthrange", "colorsys.rgb_to_hsv", "colorsys.rgb_to_hls", "statistics.median", "statistics.mode",
    "fnmatch.fnmatch", "fnmatch.filter", "html.escape", "shutil.copyfileobj", "urllib.parse.quote_plus",
    "random.Random.shuffle", "base64.b64encode", "dataclasses.astuple", "collections.Counter.most_common",
    "email.utils.parseaddr", "re.escape", "zipfile.is_zipfile", "mimetypes.guess_type", "linecache.getline",
    "secrets.token_hex", "difflib.get_close_matches", "heapq.nlargest",
)
# docstrings of modules, classes and functions with a few paragraphs of prose
DOCSTRINGS = (
    "heapq", "difflib", "statistics", "string", "calendar", "colorsys", "json.dumps", "textwrap.dedent",
    "difflib.SequenceMatcher", "collections.namedtuple", "functools.lru_cache", "statistics.stdev",
)

CODE_TASKS = (
    "Add type hints to this Python function. Reply with the whole function in a code block, otherwise unchanged.",
    "Improve the docstring of this Python function (say what each argument is and what it returns). Reply with the "
    "whole function in a code block; do not change the code.",
    "Rename the local variables of this Python function to clearer names. Reply with the whole function in a code "
    "block.",
    "This Python function has one bug. Reply with the corrected function in a code block, then say what you changed.",
)
DOC_TASKS = (
    "Quote, word for word, the sentence of this passage that best says what it describes, then summarise the rest "
    "in two sentences.",
    "Summarise this documentation in a few sentences, quoting its examples exactly.",
    "Rewrite this text as a bulleted list, keeping every sentence word for word.",
    "Repeat this passage exactly, then explain it in one sentence.",
)
MAX_DOC_CHARS = 2500
# one deterministic bug per "fix" prompt: the first of these replacements that applies
MUTATIONS = ((" == ", " != "), (" < ", " <= "), (" + 1", " - 1"), (" >= ", " > "), (" not in ", " in "),
             ("return ", "return not "))


def _resolve(name: str):
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def _source(name: str) -> str | None:
    """The function's source, dedented (methods are indented in their class)."""
    try:
        return textwrap.dedent(inspect.getsource(_resolve(name))).strip("\n")
    except (ImportError, AttributeError, OSError, TypeError):  # frozen, builtin, or not in this Python
        return None


def _doc(name: str) -> str | None:
    try:
        doc = inspect.getdoc(_resolve(name))
    except (ImportError, AttributeError):
        return None
    if not doc or len(doc) < 200:
        return None
    if len(doc) > MAX_DOC_CHARS:  # cut at a paragraph boundary
        cut = doc.rfind("\n\n", 0, MAX_DOC_CHARS)
        doc = doc[:cut if cut > 0 else MAX_DOC_CHARS]
    return doc.strip()


def _with_bug(src: str) -> str | None:
    body = src.split('"""')[-1] if src.count('"""') >= 2 else src  # the code after the docstring
    head = src[: len(src) - len(body)]
    for old, new in MUTATIONS:
        if old in body:
            return head + body.replace(old, new, 1)
    return None


def copy_prompts() -> list[str]:
    """The set's user messages: one per function (tasks rotating), then one per docstring (tasks rotating)."""
    prompts = []
    sources = [s for s in map(_source, FUNCTIONS) if s is not None]
    for i, src in enumerate(sources):
        task = CODE_TASKS[i % len(CODE_TASKS)]
        if task is CODE_TASKS[3]:
            buggy = _with_bug(src)
            if buggy is None:
                task = CODE_TASKS[0]
            else:
                src = buggy
        prompts.append(f"{task}\n\n```python\n{src}\n```")
    docs = [d for d in map(_doc, DOCSTRINGS) if d is not None]
    for i, doc in enumerate(docs):
        prompts.append(f"{DOC_TASKS[i % len(DOC_TASKS)]}\n\n{doc}")
    return prompts
