"""The pages point at what exists: every relative link of README.md and docs/ names a file of the
repository (and, with #anchor, a heading of it), and every "<page>.md, '<section>'" reference in the code,
the scripts and the pages names a heading of that page."""
import glob
import os
import re

from conftest import ROOT

PAGES = ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=ROOT))


def headings(page):
    """A page's headings, as written and as GitHub's anchors (lower case, punctuation dropped, '-' for spaces)."""
    names = [m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", open(os.path.join(ROOT, page)).read(), re.M)]
    return set(names), {re.sub(r"[^\w\- ]", "", n.lower()).replace(" ", "-") for n in names}


def test_every_link_names_a_file_and_heading_that_exist():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", open(os.path.join(ROOT, page)).read()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            assert os.path.exists(os.path.join(ROOT, path)), f"{page} links {target}: no such file"
            if anchor:
                assert anchor in headings(path)[1], f"{page} links {target}: no such heading in {path}"


def test_every_named_section_exists():
    missing = []
    files = [f for pattern in ("*.py", "*.sh", "*.md", "*/*.py", "*/*.md", "*/*.sh")
             for f in glob.glob(pattern, root_dir=ROOT) if not f.startswith((".venv", "runs"))]
    for f in files:
        text = open(os.path.join(ROOT, f), errors="replace").read()
        for page, section in re.findall(r"((?:docs/)?\w+\.md)[,:]? '([^']+)'", text):
            path = page if page.startswith("docs/") or page == "README.md" else f"docs/{page}"
            section = re.sub(r"\s*\n\s*#?\s*", " ", section)  # a name that wraps onto the next line
            if not os.path.exists(os.path.join(ROOT, path)) or section not in headings(path)[0]:
                missing.append(f"{f}: {page}, '{section}'")
    assert not missing, "sections named that do not exist:\n" + "\n".join(missing)
