"""Synthetic document pages for the page-images benchmark: a letter (lines of text), a table
and a receipt, drawn with Pillow from a seed, saved as PNG."""

from __future__ import annotations

import random
from pathlib import Path

from PIL import Image, ImageDraw

KINDS = ("letter", "table", "receipt")
WORDS = [
    "invoice",
    "order",
    "amount",
    "shipped",
    "account",
    "balance",
    "due",
    "payment",
    "total",
    "customer",
    "item",
    "date",
    "number",
    "quantity",
    "price",
    "tax",
    "discount",
    "address",
    "contact",
    "reference",
    "terms",
    "net",
]


def _letter(draw: ImageDraw.ImageDraw, rng: random.Random, width: int, height: int) -> None:
    draw.text((40, 30), f"Ref {rng.randint(1000, 9999)} - {rng.choice(WORDS).title()}", "black")
    y = 70
    while y < height - 40:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 11))]
        draw.text((40, y), " ".join(words), "black")
        y += 18 if rng.random() > 0.15 else 34  # paragraph breaks
    draw.line((40, height - 30, width // 2, height - 30), "black")


def _table(draw: ImageDraw.ImageDraw, rng: random.Random, width: int, height: int) -> None:
    draw.text((40, 30), f"Statement {rng.randint(100, 999)}", "black")
    columns, rows = 4, rng.randint(10, 18)
    cell_w, cell_h = (width - 80) // columns, 28
    for r in range(rows + 1):
        y = 70 + r * cell_h
        draw.line((40, y, 40 + columns * cell_w, y), "black")
        for c in range(columns):
            if r < rows:
                text = rng.choice(WORDS) if c == 0 else f"{rng.uniform(1, 999):.2f}"
                draw.text((46 + c * cell_w, y + 8), text, "black")
    for c in range(columns + 1):
        x = 40 + c * cell_w
        draw.line((x, 70, x, 70 + rows * cell_h), "black")


def _receipt(draw: ImageDraw.ImageDraw, rng: random.Random, width: int, height: int) -> None:
    draw.text((width // 2 - 40, 24), "STORE RECEIPT", "black")
    y, total = 60, 0.0
    for _ in range(rng.randint(6, 14)):
        price = rng.uniform(0.5, 60)
        total += price
        draw.text((20, y), f"{rng.choice(WORDS)} x{rng.randint(1, 4)}", "black")
        draw.text((width - 90, y), f"{price:8.2f}", "black")
        y += 20
    draw.line((20, y + 6, width - 20, y + 6), "black")
    draw.text((20, y + 14), "TOTAL", "black")
    draw.text((width - 90, y + 14), f"{total:8.2f}", "black")


def render_pages(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """`count` pages cycling through KINDS (letter and table 600 x 800, receipt 320 x 640),
    each from its own seed, as folder/page-NNN-KIND.png."""
    folder.mkdir(parents=True, exist_ok=True)
    draw_kind = {"letter": _letter, "table": _table, "receipt": _receipt}
    paths = []
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        rng = random.Random(seed * 100_003 + i)
        width, height = (320, 640) if kind == "receipt" else (600, 800)
        image = Image.new("RGB", (width, height), "white")
        draw_kind[kind](ImageDraw.Draw(image), rng, width, height)
        path = folder / f"page-{i:03d}-{kind}.png"
        image.save(path)
        paths.append(path)
    return paths
