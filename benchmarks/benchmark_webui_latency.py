"""Web UI: click -> audible sound in a real browser, and gaps during playback, for the live player.

    python benchmarks/benchmark_webui_latency.py [--model-dir DIR] [--takes 5] [--device cpu] [--json PATH]

The app runs on loopback (the tiny generated bundle unless ``--model-dir``); Debian's chromium, driven by
Playwright, clicks Generate with streaming on (cross-lingual, a built-in-style prompt, fixed seeds). Per take:

* click -> sound: the Generate click to the moment the first piece is scheduled to be heard (the
  AudioContext's start time of the first buffer plus its output latency), in the page's clock;
* server first chunk -> sound: the server's wall-clock time of its first chunk to that moment (same
  machine, same clock): the part the browser adds;
* stalls: pieces that arrived after the previous one had finished playing, with the gap.

Baseline from the same run: the previous design, Gradio's streaming ``gr.Audio(streaming=True,
autoplay=True)`` fed the same chunks as WAV bytes (Gradio re-encodes them into HLS segments); its sound
starts at the audio element's ``playing`` event, and ``waiting`` events count its stalls.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import platform
import socket
import statistics
import sys
import time
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXT = "Hello there, this take is streamed to you while the model is still speaking."
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--autoplay-policy=no-user-gesture-required"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _prompt(path: Path) -> Path:
    """A 2 s voiced, vowel-like 16 kHz recording (the benchmark needs no speech, only a valid prompt)."""
    import numpy as np
    import soundfile as sf

    sr = 16000
    t = np.arange(2 * sr) / sr
    phase = 2 * np.pi * np.cumsum(120 + 30 * np.sin(2 * np.pi * 0.8 * t)) / sr
    voice = sum(np.sin(k * phase) / k for k in range(1, 12)) * 0.5 * (1 - np.cos(2 * np.pi * 3 * t))
    sf.write(path, (0.3 * voice).astype(np.float32), sr, subtype="PCM_16")
    return path


def baseline_page(studio, prompt: Path, times: dict):
    """The previous player: Gradio's streamed gr.Audio fed WAV chunks by the same service."""
    import gradio as gr
    import soundfile as sf

    from cosyvoice.service import SynthesisRequest

    def run(seed: float):
        times["start"] = time.time()
        first = None
        session = studio.service.synthesize(SynthesisRequest(text=TEXT, mode="cross_lingual", prompt_audio=str(prompt),
                                                             seed=int(seed), stream=True))
        with contextlib.closing(session):
            for chunk in session:
                first = first or time.time()
                times["first_chunk"] = first
                buffer = io.BytesIO()
                sf.write(buffer, chunk.int16(), chunk.sample_rate, format="WAV", subtype="PCM_16")
                yield buffer.getvalue()
        times["finished"] = time.time()

    with gr.Blocks() as page:
        seed = gr.Number(1, elem_id="seed")
        button = gr.Button("Generate", elem_id="generate")
        player = gr.Audio(streaming=True, autoplay=True, interactive=False, elem_id="player")
        button.click(run, seed, player)
    return page


def measure_live(page, studio, seed: int) -> dict:
    page.fill("#seed input", str(seed))
    page.click("#generate")
    page.wait_for_function("() => { const t = Object.values(window.cvStudio.takes).at(-1);"
                           " return t && t.streamDone && t.firstSoundAt !== null }", timeout=300000)
    take = page.evaluate("() => window.cvStudio.summary(Object.keys(window.cvStudio.takes).at(-1))")
    server = studio.times[take["id"]]
    page.evaluate("() => window.cvStudio.stop()")
    page.wait_for_function("() => !document.querySelector('#generate').disabled")
    return {"click_to_sound_ms": take["firstSoundAt"] - take["clickAt"],
            "first_chunk_to_sound_ms": take["firstSoundAt"] - server.first_chunk * 1000,
            "stalls": take["stalls"], "gaps_ms": take["gapsMs"]}


def measure_baseline(page, times: dict, seed: int) -> dict:
    page.evaluate("""() => {  // media events do not bubble: listen in the capture phase
        window.bench = {playing: null, waiting: 0};
        if (window.benchHooked) return;
        window.benchHooked = true;
        document.addEventListener('playing', () => { if (window.bench.playing === null)
            window.bench.playing = performance.timeOrigin + performance.now(); }, true);
        document.addEventListener('waiting', () => { if (window.bench.playing !== null)
            window.bench.waiting += 1; }, true);
    }""")
    times.clear()
    page.fill("#seed input", str(seed))
    click = page.evaluate("() => performance.timeOrigin + performance.now()")
    page.click("#generate")
    page.wait_for_function("() => window.bench.playing !== null", timeout=300000)
    while "finished" not in times:
        time.sleep(0.05)
    time.sleep(2)  # let early segment edges play (where the old player stalled)
    bench = page.evaluate("() => window.bench")
    page.evaluate("() => document.querySelectorAll('audio').forEach(a => a.pause())")
    return {"click_to_sound_ms": bench["playing"] - click,
            "first_chunk_to_sound_ms": bench["playing"] - times["first_chunk"] * 1000,
            "stalls": bench["waiting"], "gaps_ms": []}


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="model folder (default: a generated tiny bundle)")
    parser.add_argument("--takes", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--json", type=Path, help="also write the raw numbers here")
    return parser.parse_args()


def measure(studio, work: Path, chromium: str, takes: int) -> dict[str, list[dict]]:
    """Both players served, each measured ``takes`` times in turn in one browser: their rows of numbers."""
    from playwright.sync_api import sync_playwright

    from app.ui import launch

    prompt = _prompt(work / "prompt.wav")
    port, base_port = _port(), _port()
    live_app = launch(studio, port=port, block=False)
    times: dict = {}
    base_app = baseline_page(studio, prompt, times)
    base_app.launch(server_port=base_port, prevent_thread_lock=True, quiet=True, ssr_mode=False)
    rows: dict[str, list[dict]] = {"live player (this UI)": [], "Gradio streamed gr.Audio (baseline)": []}
    try:
        with sync_playwright() as playwright:
            ctx = playwright.chromium.launch_persistent_context(
                str(work / "profile"), executable_path=chromium, headless=True, args=FLAGS)
            live = ctx.new_page()
            live.goto(f"http://127.0.0.1:{port}/")
            live.get_by_role("tab", name="Cross-lingual").click()
            live.set_input_files("#prompt input[type=file]", str(prompt))
            live.wait_for_selector("#prompt [data-testid='download-link']")
            live.fill("#text textarea", TEXT)
            base = ctx.new_page()
            base.goto(f"http://127.0.0.1:{base_port}/")
            base.wait_for_selector("#player")
            for take in range(takes):  # interleaved, so both see the same machine load
                rows["live player (this UI)"].append(measure_live(live, studio, take + 1))
                rows["Gradio streamed gr.Audio (baseline)"].append(measure_baseline(base, times, take + 1))
            ctx.close()
    finally:
        live_app.close()
        base_app.close()
    return rows


def report(args: argparse.Namespace, model_dir: str, rows: dict[str, list[dict]]) -> None:
    """The Markdown table (and the raw numbers to ``--json``)."""
    versions = {name: metadata.version(name) for name in ("gradio", "playwright", "torch")}
    print(f"# Web UI click -> sound ({datetime.date.today()}, {platform.processor() or platform.machine()}, "
          f"{args.device}, model {'tiny generated bundle' if args.model_dir is None else model_dir}, "
          f"{args.takes} takes each, cross-lingual, streaming; "
          + ", ".join(f"{k} {v}" for k, v in versions.items()) + ")\n")
    print("| player | click -> sound, median (ms) | server first chunk -> sound, median / max (ms) | stalls |")
    print("| --- | --- | --- | --- |")
    for name, takes in rows.items():
        added = [t["first_chunk_to_sound_ms"] for t in takes]
        print(f"| {name} | {statistics.median(t['click_to_sound_ms'] for t in takes):.0f} | "
              f"{statistics.median(added):.0f} / {max(added):.0f} | {sum(t['stalls'] for t in takes)} |")
    if args.json:
        args.json.write_text(json.dumps({"versions": versions, "rows": rows}, indent=2))


def main() -> None:
    args = _arguments()
    import torch
    from benchmark_performance import scratch_dir

    from app.ui import load_studio

    torch.set_num_threads(1)
    work = scratch_dir("bench-webui-")
    model_dir = args.model_dir
    if model_dir is None:
        from cosyvoice.tools.make_tiny_bundle import make_tiny_bundle

        model_dir = str(make_tiny_bundle(work / "tiny", seed=7))
    studio = load_studio(model_dir, voice_dir=work / "voices", device=args.device, builtin_dir=None)
    report(args, model_dir, measure(studio, work, args.chromium, args.takes))


if __name__ == "__main__":
    main()
