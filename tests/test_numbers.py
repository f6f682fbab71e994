"""Numbers that cannot drift: a section of README.md or docs/ that quotes a results table says so with a
line `<!-- numbers: bench/results/NAME.md -->` (one or more tables), and every number it quotes in its
prose - a decimal (57.7, 0.83, -0.84) or a percentage (6%) outside code blocks - must appear in one of
those tables. A section without the line is not checked (pages get it as their numbers are rewritten from
one named set of runs); the unit test below shows the check failing on a page quoting a number its table
does not hold."""
import glob
import os
import re

from conftest import ROOT

PAGES = ["README.md"] + sorted(glob.glob("docs/*.md", root_dir=ROOT))
DECLARE = re.compile(r"<!--\s*numbers:\s*([^>]*?)\s*-->")
NUMBER = re.compile(r"(?<![\w.])[-+]?\d+\.\d+(?![\w.]*\d)|(?<![\w.])\d+(?:\.\d+)?(?=%)")


def sections(text):
    """(heading, body) of each section (split at '#' headings); fenced code blocks removed."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    parts = re.split(r"^(#+ .*)$", text, flags=re.M)
    return [("", parts[0])] + list(zip(parts[1::2], parts[2::2]))


def table_numbers(path):
    """Every number written in a results table, as written and with trailing zeros dropped."""
    found = set(re.findall(r"[-+]?\d+(?:\.\d+)?", open(path, encoding="utf-8").read()))
    found |= {n.lstrip("+") for n in found}  # a gain written +44.2 in a table, 44.2 in prose
    return found | {n.rstrip("0").rstrip(".") for n in found if "." in n}


def drift(page_text, root=ROOT):
    """The numbers a page quotes that its sections' declared tables do not hold -> ['heading: number (tables)']."""
    problems = []
    for heading, body in sections(page_text):
        tables = [t for m in DECLARE.finditer(body) for t in m.group(1).split()]
        if not tables:
            continue
        missing = [t for t in tables if not os.path.isfile(os.path.join(root, t))]
        if missing:
            problems.append(f"{heading}: cites {', '.join(missing)}, which does not exist")
            continue
        held = set().union(*(table_numbers(os.path.join(root, t)) for t in tables))
        prose = DECLARE.sub("", re.sub(r"`[^`]*`", "", body))  # inline code (flags, paths) is not a result
        for n in NUMBER.findall(prose):
            if n.lstrip("+") not in held and n.lstrip("+").rstrip("0").rstrip(".") not in held:
                problems.append(f"{heading}: {n} ({', '.join(tables)})")
    return problems


def test_every_quoted_number_is_in_the_table_its_section_cites():
    problems = [f"{page}: {p}" for page in PAGES for p in drift(open(os.path.join(ROOT, page)).read())]
    assert not problems, "numbers not in the tables their sections cite:\n" + "\n".join(problems)


def test_a_page_quoting_a_number_its_table_does_not_hold_fails(tmp_path):
    (tmp_path / "bench" / "results").mkdir(parents=True)
    table = "| row | seen | unseen |\n|---|---|---|\n| BC | 45.5 | 50.0 |\n| Q-Evolve | 64.8% | 60.2 |\n"
    (tmp_path / "bench" / "results" / "t.md").write_text(table)
    good = ("# Page\n\nNot checked: 99.9.\n\n## Results\n<!-- numbers: bench/results/t.md -->\n"
            "BC reaches 45.5 / 50 and Q-Evolve 64.8% / 60.2 (`--lr 3.5e-4` is a flag, not a result).\n"
            "```bash\npython x.py --tau 0.7\n```\n")
    assert drift(good, str(tmp_path)) == []
    bad = good.replace("64.8% / 60.2", "65.0 / 57.5")
    assert drift(bad, str(tmp_path)) == ["## Results: 65.0 (bench/results/t.md)",
                                         "## Results: 57.5 (bench/results/t.md)"]
    assert drift(good.replace("t.md", "gone.md"), str(tmp_path)) == [
        "## Results: cites bench/results/gone.md, which does not exist"]
