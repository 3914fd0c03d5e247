"""The documentation keeps up with the code: every setting leases/conf.py reads, and every
system check id it and leases/db.py can raise, has its place on docs/settings.md; and
every link between the Markdown pages names a heading that exists, by the anchor GitHub
gives it (the pages are read there as well as in the built site)."""
from __future__ import annotations

import ast
import re
import unicodedata
from pathlib import Path

import pytest

from tests.conftest import ROOT

DOCS = ROOT / "docs"
SETTINGS_PAGE = DOCS / "settings.md"
FENCE = re.compile(r"^(`{3,}).*?^\1\s*$", re.S | re.M)
LINK = re.compile(r"\]\(([^)#\s]*)#([^)\s]+)\)")


def settings_read(source: Path) -> set[str]:
    """Names of the LEASES_* settings a module reads: getattr(settings, "LEASES_X", ...)
    and settings.LEASES_X."""
    found = set()
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)):
            found.add(node.args[1].value)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "settings":
            found.add(node.attr)
    return {name for name in found if name.startswith("LEASES_")}


def headings(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    return re.findall(r"^#{1,6} +(.+?) *#* *$", text, flags=re.M)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (hyphens and
    underscores kept), each space a hyphen."""
    text = re.sub(r"<[^>]+>|`", "", heading).strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LNM")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on the page; a repeated one gets -1, -2, ... as on GitHub."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in headings(page):
        slug = github_anchor(heading)
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_every_leases_setting_read_in_conf_has_its_section_on_the_settings_page():
    read = settings_read(ROOT / "leases" / "conf.py")
    assert len(read) >= 7, f"leases/conf.py reads fewer settings than it did: {sorted(read)}"
    documented = {re.sub(r"`", "", heading) for heading in headings(SETTINGS_PAGE)}
    missing = sorted(read - documented)
    assert not missing, f"docs/settings.md has no '### `NAME`' section for: {', '.join(missing)}"


def test_every_check_id_has_its_row_on_the_settings_page():
    sources = [ROOT / "leases" / "conf.py", ROOT / "leases" / "db.py", ROOT / "leases" / "management" / "base.py"]
    ids = {match for source in sources for match in re.findall(r"leases\.[EW]\d{3}", source.read_text(encoding="utf-8"))}
    assert len(ids) >= 16, f"fewer check ids than the code had: {sorted(ids)}"
    rows = set(re.findall(r"^\| `(leases\.[EW]\d{3})` \|", SETTINGS_PAGE.read_text(encoding="utf-8"), flags=re.M))
    missing = sorted(ids - rows)
    assert not missing, f"docs/settings.md's table of checks has no row for: {', '.join(missing)}"


@pytest.mark.parametrize("page", [ROOT / "README.md", *sorted(DOCS.glob("*.md"))], ids=lambda page: page.name)
def test_links_between_pages_name_headings_by_their_github_anchor(page):
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    broken = []
    for match in LINK.finditer(text):
        target = page.parent / match.group(1) if match.group(1) else page
        if not target.is_file():
            broken.append(f"{match.group(0)}: no such page")
        elif match.group(2) not in anchors(target):
            broken.append(f"{match.group(0)}: no heading with that anchor on {target.name}")
    assert not broken, "\n".join(broken)


def test_the_github_anchor_of_a_heading_is_githubs():
    assert github_anchor("The worker: `manage.py leases_worker`") == "the-worker-managepy-leases_worker"
    assert github_anchor("Resource leases: `bench/leases.py`") == "resource-leases-benchleasespy"
    assert github_anchor("`ttl` and `keep_alive`: which to choose") == "ttl-and-keep_alive-which-to-choose"
