"""Start the CosyVoice3 Studio web UI.

    python webui.py [--port 8000] [--host 127.0.0.1] [--model-dir DIR_OR_MODELSCOPE_ID] [--voice-dir DIR]
                    [--precision fp32|bf16|int8|auto]
                    [--api-key KEY ...]

Without --model-dir it serves pretrained_models/Fun-CosyVoice3-0.5B of this repository (wherever it is
started from), or, when that folder is absent, a randomly initialised demo model (noise-like audio; the
page and the log say so). Built-in voices come from assets/voices (<name>.wav + <name>.txt). Voices are kept
where the servers keep them (COSYVOICE_VOICE_DIR, else pretrained_models/.voices), so all of them share one
library. With API keys (COSYVOICE_API_KEYS=k1,k2 or --api-key) nothing answers without one: browsers sign in
with a key on a small page, clients send "Authorization: Bearer KEY". Each visitor sees only their own
takes, tests and projects (COSYVOICE_SHARING=team shares them; COSYVOICE_ADMIN_KEYS see everything); on
127.0.0.1 without keys, also this machine's own (the batch CLI's).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from dataclasses import replace

from app.ui import BUILTIN_VOICE_DIR, DEMO_MODEL_DIR, launch, load_studio
from cosyvoice.backends import precision
from cosyvoice.errors import command_line_errors
from cosyvoice.settings import ServerSettings, default_voice_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    # a Hugging Face Space assigns the address and port through Gradio's own variables
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 8000)))
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                        help="0.0.0.0 serves other machines too (default: %(default)s)")
    parser.add_argument("--model-dir", help="model folder or ModelScope id (default: pretrained_models/"
                                            "Fun-CosyVoice3-0.5B, else a demo model)")
    parser.add_argument("--voice-dir", default=str(default_voice_dir()),
                        help="where voices are kept, shared with the servers (env COSYVOICE_VOICE_DIR; %(default)s)")
    parser.add_argument("--demo-dir", default=str(DEMO_MODEL_DIR), help="where the demo model is written")
    parser.add_argument("--builtin-voice-dir", default=str(BUILTIN_VOICE_DIR),
                        help="built-in voices, <name>.wav + <name>.txt (%(default)s)")
    parser.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    parser.add_argument("--precision", choices=precision.CHOICES,
                        help="CPU: fp32, bf16 or int8 weights, or auto (default: COSYVOICE_PRECISION, else fp32)")
    parser.add_argument("--api-key", action="append", dest="api_keys", metavar="KEY",
                        help="accept this key (repeat for more; env COSYVOICE_API_KEYS=k1,k2); none: no sign-in")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    with command_line_errors():  # a bad setting or model folder: one line, exit 2
        # the web UI's own address: a keyless page on loopback also shows this machine's own work (auto sharing)
        settings = replace(ServerSettings.from_env(), host=args.host)
        if args.api_keys:
            settings = replace(settings, api_keys=tuple(args.api_keys))
        studio = load_studio(args.model_dir, voice_dir=args.voice_dir, demo_dir=args.demo_dir,
                             builtin_dir=args.builtin_voice_dir, device=args.device, precision=args.precision,
                             settings=settings)
    # a service manager's stop (SIGTERM: systemd, docker, a Space) ends the page as Ctrl-C does: the server closes
    # and the process's exit hooks run, which remove the handed-out files' folder (app.files.PageFiles)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    launch(studio, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
