"""A report page rendered by real headless Chromium shows its curves: two overlaid metrics files
draw the first file's colour (#1f77b4) and the second's (#d62728) as lines in the charts and their
memory bars at 55 % opacity, counted pixel by pixel in the screenshot (PNG decoded with zlib and
struct). The same page with its curves taken out must fail the same check, so a page that drew no
curves could not pass. Exits 77 (ctest's skip) when chromium is not installed.
Usage: test_render.py PATH/TO/partrain"""
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, ".."))
sys.path.insert(0, here)
from checks import check, finish  # noqa: E402
import metrics_files as mf  # noqa: E402

BIN = os.path.abspath(sys.argv[1])
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if not CHROMIUM:
    print("SKIP: chromium is not installed (scripts/setup installs it), so the page cannot be rendered")
    sys.exit(77)
tmp = tempfile.mkdtemp(prefix="render-test-")
WIDTH, HEIGHT = 1100, 2300


def render(html_path, png_path):
    """Screenshots the page with headless Chromium; returns the error text or ''."""
    if os.path.exists(png_path):
        os.remove(png_path)
    p = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--force-device-scale-factor=1", f"--window-size={WIDTH},{HEIGHT}",
                        f"--user-data-dir={tmp}/profile", f"--screenshot={png_path}", "file://" + html_path],
                       capture_output=True, text=True, timeout=120)
    return "" if os.path.isfile(png_path) else f"status {p.returncode}: {p.stderr[-2000:]}"


def paeth(a, b, c):
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def decode_png(path):
    """(width, height, rows of RGB tuples) of an 8-bit, non-interlaced RGB or RGBA PNG."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, []
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
    assert depth == 8 and interlace == 0 and ctype in (2, 6), (depth, ctype, interlace)
    bpp = 3 if ctype == 2 else 4
    raw = zlib.decompress(b"".join(idat))
    stride = w * bpp
    prev = bytearray(stride)
    rows = []
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        if f == 1:
            for i in range(bpp, stride):
                line[i] = (line[i] + line[i - bpp]) & 255
        elif f == 2:
            line = bytearray(map(lambda a, b: (a + b) & 255, line, prev))
        elif f == 3:
            for i in range(stride):
                line[i] = (line[i] + ((line[i - bpp] if i >= bpp else 0) + prev[i]) // 2) & 255
        elif f == 4:
            for i in range(stride):
                a = line[i - bpp] if i >= bpp else 0
                c = prev[i - bpp] if i >= bpp else 0
                line[i] = (line[i] + paeth(a, prev[i], c)) & 255
        rows.append(line)
        prev = line
    return w, h, bpp, rows


def count_near(png, rgb, within=40):
    """Pixels whose colour is within `within` (Euclidean, RGB) of `rgb`."""
    w, h, bpp, rows = png
    r0, g0, b0 = rgb
    lim = within * within
    n = 0
    for line in rows:
        for i in range(0, w * bpp, bpp):
            dr, dg, db = line[i] - r0, line[i + 1] - g0, line[i + 2] - b0
            if dr * dr + dg * dg + db * db <= lim:
                n += 1
    return n


def hex_rgb(h):
    return tuple(int(h[i:i + 2], 16) for i in (1, 3, 5))


def over_white(rgb, alpha):
    return tuple(round(c * alpha + 255 * (1 - alpha)) for c in rgb)


BLUE, RED = hex_rgb("#1f77b4"), hex_rgb("#d62728")
a = mf.write(os.path.join(tmp, "a.jsonl"), [mf.header()] + mf.steps(60) + [mf.memory(60, [3 << 30, 4 << 30])])
b = mf.write(os.path.join(tmp, "b.jsonl"), [mf.header()] + mf.steps(60, loss=lambda s: 4.0 - s / 30.0,
                                                                   lr=lambda s: 0.002, tps=lambda s: 9000.0 + 40 * s)
             + [mf.memory(60, [2 << 30, 5 << 30])])
page = os.path.join(tmp, "ab.html")
p = subprocess.run([BIN, "report", a, b, "-o", page], capture_output=True, text=True, timeout=120)
check("the report of two files is written", p.returncode == 0, p.stdout + p.stderr)
with open(page) as f:
    html = f.read()
# The same page without its curves: what the check must reject.
bare = os.path.join(tmp, "bare.html")
with open(bare, "w") as f:
    f.write(re.sub(r'<(path|circle) class="series".*?(</path>|/>)\n', "", html))

counts = {}
for name, path in (("page", page), ("bare page", bare)):
    png = os.path.join(tmp, name.replace(" ", "_") + ".png")
    err = render(path, png)
    check(f"chromium renders the {name} to PNG", not err, err)
    if err:
        continue
    image = decode_png(png)
    check(f"the {name}'s screenshot is {WIDTH}x{HEIGHT}", image[:2] == (WIDTH, HEIGHT), image[:2])
    counts[name] = {c: count_near(image, rgb) for c, rgb in
                    (("blue", BLUE), ("red", RED), ("blue bars", over_white(BLUE, 0.55)),
                     ("red bars", over_white(RED, 0.55)))}
    print(f"     {name}: pixels of each colour: {counts[name]}", flush=True)

if len(counts) == 2:
    full, empty = counts["page"], counts["bare page"]
    # Legend swatches carry the colours too (a few hundred pixels); three charts of curves 2 px wide
    # and ~900 px long add thousands.
    def curves_drawn(c, colour):
        return c[colour] >= 2000

    for colour in ("blue", "red"):
        check(f"the {colour} file's curves are on the page ({full[colour]} pixels)", curves_drawn(full, colour), full)
        check(f"without its curves the check fails for {colour} ({empty[colour]} pixels: the legends alone)",
              not curves_drawn(empty, colour), empty)
        check(f"the {colour} file's memory bars are drawn ({full[colour + ' bars']} pixels)",
              full[colour + " bars"] >= 2000, full)
finish("render")
