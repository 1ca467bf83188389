"""Writes the decode-bomb fixtures of tests/test_audio_frontend.py (run once; encoding takes minutes).

255-channel Ogg Vorbis silence: a few hundred KB that decode to gigabytes of float32 (issue 12 item 7 measured
3.3 GB at 48 kHz and 7.8 GB at 192 kHz in a server that decoded before checking the channel count).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import soundfile as sf

BOMBS = {"bomb_255ch_48k.ogg": (48000, 34), "bomb_255ch_192k.ogg": (192000, 20)}


def main(folder: Path) -> None:
    for name, (rate, seconds) in BOMBS.items():
        block = np.zeros((rate // 10, 255), np.float32)
        with sf.SoundFile(folder / name, "w", samplerate=rate, channels=255, format="OGG", subtype="VORBIS") as f:
            for _ in range(seconds * 10):
                f.write(block)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)
