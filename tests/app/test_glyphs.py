"""Issue 38 (7): every symbol the page writes has a glyph in the fonts a plain Debian machine has (DejaVu):
the no-entry sign, an hourglass or a filing cabinet render there as an empty box."""

import re
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parents[2] / "app"
# characters DejaVu Sans draws (checked with fc-list ':charset=XXXX'): marks, arrows, the warning sign, the
# progress bars' full and light-shade blocks (2588, 2591)
DRAWN = set("✓✗✖⚠…·±→←↑↓×—–−≥≤°µ█░")


@pytest.mark.parametrize("path", sorted(APP.glob("*.py")), ids=lambda p: p.name)
def test_the_page_s_symbols_have_a_glyph(path):
    symbols = set(re.findall(r"[^\x00-\x7f]", path.read_text())) - DRAWN
    # letters with accents and typographic quotes are text, not symbols
    symbols = {c for c in symbols if not c.isalpha() and c not in "‘’“”"}
    assert not symbols, f"{path.name}: {sorted(symbols)} may have no glyph on a plain machine"
