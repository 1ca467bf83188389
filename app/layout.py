"""The studio page: its layout, one builder per part (header, form, voice column, history), and the wiring of
each part's events to the :class:`~app.studio.Studio`'s handlers; the named API's endpoints first, so that they get
their names unsuffixed. The page's events are private; the API is the named endpoints."""

from __future__ import annotations

import gradio as gr

from app.api import NamedApi
from app.files import FILE_LIFETIME_SECONDS
from app.i18n import t
from app.studio import Studio
from app.take_form import DOWNLOAD_FORMATS
from cosyvoice.service import draw_seed
from cosyvoice.settings import FLOW_STEPS_RANGE, SPEED_RANGE

MODES = ("zero_shot", "cross_lingual", "instruct2")
PRIVATE = {"api_visibility": "private"}

CSS = """
#live-player { display:flex; align-items:center; gap:8px; min-height:24px; font-size:14px; }
#live-player .live-dot { width:10px; height:10px; border-radius:50%; background:#9ca3af; }
#live-player[data-state=playing] .live-dot { background:#16a34a; }
#live-player[data-state=waiting] .live-dot { background:#f59e0b; }
#live-player[data-state=failed] { color:#b91c1c; font-weight:600; }  /* the cause, where the status is read */
#live-player[data-state=failed] .live-dot { background:#b91c1c; flex:none; }
#queue-place { font-size:14px; color:#b45309; font-weight:600; }
#queue-eta { font-size:13px; color:#b45309; }
#status { min-height:40px; }
#status > .wrap { display:none !important; }  /* Gradio's progress ("queue: 2/2"): player.js says the place */
.cv-hidden { display:none !important; }
#take-history .history-views { display:flex; gap:8px; margin-bottom:8px; }
#take-history .history-view { padding:4px 10px; border:1px solid #d1d5db; border-radius:6px; background:none; }
#take-history .history-view[aria-pressed=true] { background:#e5e7eb; font-weight:600; }
#take-history .take { border-top:1px solid #e5e7eb; padding:10px 0; }
#take-history .take-text { margin:6px 0; color:#374151; }
#take-history audio { width:100%; max-width:560px; display:block; }
#take-history .take-actions { display:flex; gap:12px; align-items:center; margin-top:6px; }
#take-history .take-actions button { padding:2px 10px; border:1px solid #d1d5db; border-radius:6px; background:none;
                                    font-size:13px; font-weight:normal; }
#take-history .history-error { color:#b91c1c; }
#demo-banner { background:#b91c1c; color:#fff; padding:12px 16px; border-radius:8px; font-weight:600; }
#demo-banner p, #demo-banner code { color:#fff; }
#demo-banner code { background:rgba(0, 0, 0, 0.25); }  /* room for the queue position while a take waits */
#char-counter { font-size:13px; color:#6b7280; margin-top:-8px; }
#char-counter-text.over { color:#b91c1c; font-weight:600; }
/* toasts at the top centre: never over the voice controls (save, manage) on the right or Generate */
.toast-wrap { top:16px !important; bottom:auto !important; left:50% !important; right:auto !important;
              transform:translateX(-50%); max-width:min(480px, calc(100vw - 32px)); }
#mic-message { color:#b91c1c; font-size:14px; padding:6px 10px; }
/* narrow screens stack the columns: the voice picker comes first, above the text and Generate */
@media (max-width: 768px) { #voice-column { order:-1; } }
/* a phone: narrower margins and tabs, so the three modes stand side by side instead of two behind "⋯" (Gradio
   measures its hidden copy of the tab buttons, which this rule narrows too) */
@media (max-width: 480px) {
  .gradio-container .main.app { padding-left:10px !important; padding-right:10px !important; }
  .tabs .tab-container button { padding-left:10px !important; padding-right:10px !important; }
}
body, .gradio-container { font-family: ui-sans-serif, system-ui, "Noto Sans", "Noto Sans CJK SC",
                          "Noto Sans CJK JP", sans-serif; }
"""

DOWNLOAD_JS = """(file) => {
  if (!file || !file.url) return;
  const link = document.createElement("a");
  link.href = file.url;
  link.download = file.orig_name || "takes.zip";
  document.body.appendChild(link);
  link.click();
  link.remove();
}"""

COUNTER_JS = """(text) => {
  const limit = %d, n = [...(text || "")].length, zh = (navigator.language || "").startsWith("zh");
  const fmt = (x) => x.toLocaleString("en-US");
  const over = n > limit;
  const msg = over
    ? (zh ? `超出 ${fmt(limit)} 字的上限 ${fmt(n - limit)} 字：请缩短或分段生成。`
          : `${fmt(n)} / ${fmt(limit)} characters: over the limit by ${fmt(n - limit)}. Shorten the text or split it.`)
    : `${fmt(n)} / ${fmt(limit)}` + (zh ? " 字" : " characters");
  return `<div id="char-counter-text" class="${over ? "over" : ""}" data-over="${over}">${msg}</div>`;
}"""


def build_ui(studio: Studio) -> gr.Blocks:
    """The studio page over ``studio`` (served by :func:`app.ui.launch`)."""
    return StudioPage(studio).build()


class StudioPage:
    """The page's components, made in the page's order by one method per part, then wired part by part."""

    def __init__(self, studio: Studio) -> None:
        self.studio = studio
        self.limits = studio.service.limits

    def build(self) -> gr.Blocks:
        with gr.Blocks(title="CosyVoice3 Studio", analytics_enabled=False,
                       delete_cache=(3600, FILE_LIFETIME_SECONDS)) as page:
            self.page = page
            self._header()
            # no gr.State: it would make every tab hold a heartbeat connection, and browsers allow only six per
            # server; three waiting tabs would then starve each other's clicks (the takes are kept by the Studio)
            self.mode = gr.Textbox("zero_shot", visible=False, elem_id="mode")
            self.take_id = gr.Textbox(visible=False, elem_id="take-id")
            self.takes_count = gr.Number(0, visible=False, elem_id="takes-count")
            with gr.Row():
                with gr.Column(scale=3):
                    self._form()
                with gr.Column(scale=2, elem_id="voice-column"):
                    self._voice_column()
            self._history()
            named_api(self.studio.api, self.limits.max_sessions)
            self._wire_history()
            self._wire_form()
            self._wire_takes()
            self._wire_voices()
        return page

    def _header(self) -> None:
        service = self.studio.service
        if self.studio.demo:
            gr.Markdown(t("demo_banner"), elem_id="demo-banner")
        gr.Markdown("# CosyVoice3 Studio")
        gr.Markdown(t("intro"))
        gr.Markdown(t("more_tools"), elem_id="more-tools")  # the studio's other pages, served on this app
        gr.Textbox(service.precision.label, label=t("precision"), interactive=False, max_lines=1,
                   info=service.precision.summary or None,  # auto's measurements behind its choice
                   elem_id="precision")  # auto's choice is the server's; people comparing takes need to know it

    def _form(self) -> None:
        """The text, the mode's tabs, the take's settings, Generate and Stop, the player and the status."""
        self.text = gr.Textbox(label=t("text"), placeholder=t("text_placeholder"), lines=5, elem_id="text")
        self.counter = gr.HTML(elem_id="char-counter")
        with gr.Tabs() as self.tabs:
            with gr.Tab(t("zero_shot"), id="zero_shot", elem_id="tab-zero-shot") as zero_shot_tab:
                self.transcript = gr.Textbox(label=t("transcript"), lines=2, info=t("transcript_info"),
                                             elem_id="transcript")
            with gr.Tab(t("cross_lingual"), id="cross_lingual", elem_id="tab-cross-lingual") as cross_lingual_tab:
                gr.Markdown(t("cross_lingual_note"))
            with gr.Tab(t("instruct2"), id="instruct2", elem_id="tab-instruct") as instruct_tab:
                self.instruction = gr.Textbox(label=t("instruction"), placeholder="Speak slowly and calmly.",
                                              elem_id="instruction")
        self.mode_tabs = {"zero_shot": zero_shot_tab, "cross_lingual": cross_lingual_tab, "instruct2": instruct_tab}
        with gr.Row():
            self.stream = gr.Checkbox(True, label=t("stream"), elem_id="stream")
            self.speed = gr.Slider(*SPEED_RANGE, 1.0, step=0.05, label=t("speed"), elem_id="speed")
        with gr.Row():
            self.seed = gr.Number(-1, label=t("seed"), precision=0, elem_id="seed")  # range: TakeForm's words
            self.dice = gr.Button(t("dice"), size="sm", elem_id="dice")
            self.fmt = gr.Dropdown([(f.upper(), f) for f in DOWNLOAD_FORMATS], value="wav", label=t("format"),
                                   elem_id="format")
        self._advanced()
        with gr.Row():
            self.generate = gr.Button(t("generate"), variant="primary", elem_id="generate")
            self.stop = gr.Button(t("stop"), variant="stop", interactive=False, elem_id="stop")
        gr.HTML('<div id="live-player" data-state="idle"><span class="live-dot"></span>'
                '<span class="live-text"></span></div>'
                '<div id="queue-place" role="status" aria-live="polite" hidden></div>')
        self.status = gr.Markdown(elem_id="status")
        self.download = gr.File(label=t("download"), interactive=False, visible=False, elem_id="download")

    def _advanced(self) -> None:
        """The flow's steps and the chunk schedule, folded away."""
        with gr.Accordion(t("advanced"), open=False, elem_id="advanced"):
            self.steps = gr.Slider(*FLOW_STEPS_RANGE, self.studio.service.default_steps, step=1,
                                   label=t("steps"), info=t("steps_info"), elem_id="steps")
            with gr.Row():  # the chunk schedule, for blind A/B tests of its speed against the reference's
                self.final = gr.Radio([(t("final_full"), "full"), (t("final_chunked"), "chunked")], value="full",
                                      label=t("final"), info=t("final_info"), elem_id="final")
                self.first_hop = gr.Number(None, precision=0, label=t("first_hop"), info=t("first_hop_info"),
                                           elem_id="first-hop")  # out of range: the service says so by name

    def _voice_column(self) -> None:
        """The voice picker, its preview, a prompt to upload or record and save, and the saved voices' management."""
        self.voice = gr.Dropdown(label=t("voice"), choices=self.studio.voice_choices(None, uploads=False),
                                 value=None, info=t("voice_info"), elem_id="voice")
        self.preview = gr.Audio(label=t("preview"), interactive=False, elem_id="preview")
        # no Download or Share buttons: their links name the server's temporary path of the upload
        self.prompt = gr.Audio(label=t("prompt"), sources=["upload", "microphone"], type="filepath",
                               elem_id="prompt", buttons=[])
        with gr.Row():
            self.save_as = gr.Textbox(label=t("save_as"), placeholder=t("save_placeholder"), elem_id="save-as",
                                      scale=3)
            self.save = gr.Button(t("save"), size="sm", elem_id="save", scale=1)
        with gr.Accordion(t("manage"), open=False, elem_id="manage"):
            with gr.Row():
                self.new_name = gr.Textbox(label=t("rename_to"), elem_id="new-name", scale=3)
                self.rename = gr.Button(t("rename"), size="sm", elem_id="rename", scale=1)
            with gr.Row():
                self.export = gr.Button(t("export"), size="sm", elem_id="export")
                self.delete = gr.Button(t("delete"), size="sm", variant="stop", elem_id="delete")
            with gr.Row(visible=False, elem_id="confirm-row") as self.confirm_row:
                self.confirm_text = gr.Markdown()
                self.confirm = gr.Button(t("confirm_delete"), size="sm", variant="stop", elem_id="confirm-delete")
                self.cancel = gr.Button(t("cancel"), size="sm", elem_id="cancel-delete")
            self.exported = gr.File(label=t("export_file"), interactive=False, visible=False, elem_id="exported")
            self.imported = gr.File(label=t("import"), file_count="single", type="filepath", height=120,
                                    elem_id="import")
            with gr.Row():
                self.import_name = gr.Textbox(label=t("import_as"), visible=False, elem_id="import-name", scale=3)
                self.import_again = gr.Button(t("import_again"), size="sm", visible=False, elem_id="import-again",
                                              scale=1)

    def _history(self) -> None:
        """The take history, drawn by app/history.js from the workbench store: it fetches only takes it has not shown
        (no earlier take's audio is fetched again) and plays each from the store when asked."""
        with gr.Row():
            gr.Markdown(t("history"), elem_id="history-heading")
            self.takes_zip = gr.Button(t("download_all"), size="sm", elem_id="download-all", elem_classes="cv-hidden")
        self.zip_file = gr.File(visible=False, elem_id="takes-zip")
        gr.HTML('<div id="take-history" data-state="loading"></div>', elem_id="history-panel")
        self.opened = gr.Textbox(visible=False, elem_id="opened-take")
        self.open_take = gr.Button(elem_id="open-take", elem_classes="cv-hidden")  # clicked by history.js

    def _wire_history(self) -> None:
        studio = self.studio
        # history.js shows the ZIP button once this browser has takes (a load event here would queue behind takes)
        self.takes_count.change(None, None, None, js="() => window.cvHistory.refresh()", **PRIVATE)
        self.page.load(None, None, None, js="() => window.cvHistory.start()", **PRIVATE)
        self.open_take.click(studio.open_take, self.opened,
                             [self.text, self.mode, self.tabs, self.instruction, self.voice, self.seed, self.speed,
                              self.steps, self.stream, self.final, self.first_hop],
                             js="() => [window.cvHistory.opening]", show_progress="hidden", **PRIVATE)
        self.takes_zip.click(studio.history_zip, None, self.zip_file, show_progress="hidden", **PRIVATE).then(
            None, self.zip_file, None, js=DOWNLOAD_JS, **PRIVATE)

    def _wire_form(self) -> None:
        for name, tab in self.mode_tabs.items():
            tab.select(lambda name=name: name, None, self.mode, queue=False, **PRIVATE)
        counter_js = COUNTER_JS % self.limits.max_text_chars
        self.text.change(None, self.text, self.counter, js=counter_js, **PRIVATE)
        self.page.load(None, self.text, self.counter, js=counter_js, **PRIVATE)
        self.dice.click(draw_seed, None, self.seed, queue=False, **PRIVATE)

    def _wire_takes(self) -> None:
        studio, buttons = self.studio, [self.generate, self.stop]
        # one click, two events: the buttons change at once, and the take joins the queue straight away (its
        # place in the queue is the click's: first come, first served); the take id comes from the player
        self.generate.click(studio.begin, None, buttons, queue=False, show_progress="hidden", **PRIVATE)
        # a waiting take's place is said in words by player.js (cvQueue) from Gradio's own queue messages: Gradio's
        # progress ("queue: 2/2 | 0.6s") is hidden, and nothing covers the other controls
        running = self.generate.click(
            studio.generate,
            [self.take_id, self.mode, self.text, self.prompt, self.transcript, self.instruction, self.voice, self.seed,
             self.speed, self.stream, self.fmt, self.steps, self.final, self.first_hop],
            [self.status, self.download, self.takes_count, *buttons], concurrency_limit=self.limits.max_sessions,
            concurrency_id="synthesis", show_progress="hidden",
            js=f"(...inputs) => [window.cvStudio.begin({studio.service.sample_rate}), ...inputs.slice(1)]",
            **PRIVATE)
        running.then(studio.idle, None, buttons, queue=False, show_progress="hidden", **PRIVATE)
        self.stop.click(studio.stop_clicked, self.take_id, buttons, queue=False, show_progress="hidden",
                        js="() => [window.cvStudio.stop()]", **PRIVATE)

    def _wire_voices(self) -> None:
        studio, hidden = self.studio, {"show_progress": "hidden", **PRIVATE}
        # toasts travel on the queue's stream: handlers that may warn are queued (the default)
        self.prompt.upload(studio.check_upload, self.prompt, self.prompt, **hidden)
        self.prompt.stop_recording(studio.check_upload, self.prompt, self.prompt, **hidden)
        # in the browser, at once: a server round trip could land after a voice saved meanwhile and clear it
        self.prompt.upload(None, None, [self.voice, self.preview], js="() => [null, null]", **PRIVATE)
        # a picked voice replaces the recording
        self.voice.select(lambda: None, None, self.prompt, queue=False, **PRIVATE)
        self.voice.change(studio.preview, self.voice, self.preview, **hidden)
        self.save.click(studio.save_voice, [self.save_as, self.prompt, self.transcript], self.voice, **hidden)
        self.rename.click(studio.rename_voice, [self.voice, self.new_name], self.voice, **hidden)
        self.export.click(studio.export_voice, self.voice, self.exported, **hidden)
        self.exported.change(lambda path: gr.update(visible=bool(path)), self.exported, self.exported, queue=False,
                             **PRIVATE)
        import_outputs = [self.voice, self.imported, self.import_name, self.import_again]
        self.imported.upload(studio.import_voice, self.imported, import_outputs, **hidden)
        self.import_again.click(studio.import_voice, [self.imported, self.import_name], import_outputs, **hidden)
        self.delete.click(studio.ask_delete, self.voice, [self.confirm_row, self.confirm_text], **hidden)
        self.confirm.click(studio.delete_voice, self.voice, [self.voice, self.confirm_row, self.preview], **hidden)
        self.cancel.click(lambda: gr.update(visible=False), None, self.confirm_row, queue=False, **PRIVATE)
        self.page.load(studio.visitor_voices, None, self.voice, queue=False, show_progress="hidden", **PRIVATE)


def named_api(api: NamedApi, max_sessions: int) -> None:
    """Named endpoints for gradio_client: components never shown, one button per endpoint."""
    with gr.Group(visible=False):
        text = gr.Textbox(label="text")
        mode = gr.Dropdown(list(MODES), value="zero_shot", label="mode")
        voice = gr.Textbox(label="voice", info="a voice name or id, looked up at call time ('' to use prompt_audio)")
        prompt_audio = gr.Audio(type="filepath", label="prompt_audio")
        prompt_text = gr.Textbox(label="prompt_text", info="the transcript of prompt_audio (zero_shot)")
        instruction = gr.Textbox(label="instruction", info="instruct2 only")
        seed = gr.Number(-1, precision=0, label="seed", info="-1: random")
        speed = gr.Number(1.0, label="speed")
        fmt = gr.Dropdown(list(DOWNLOAD_FORMATS), value="wav", label="format")
        steps = gr.Number(None, precision=0, label="steps", info="the flow's Euler steps (empty: the model's)")
        final = gr.Dropdown(["full", "chunked"], value=None, label="final",
                            info="the last flow call: full (the reference) or chunked (empty: the reference's)")
        first_hop = gr.Number(None, precision=0, label="first_hop",
                              info="speech tokens of the first chunk (empty: the reference's)")
        result = gr.File(label="audio")
        name = gr.Textbox(label="name")
        voices = gr.JSON(label="voices")
        saved = gr.JSON(label="voice")
        run, list_voices, save = gr.Button(), gr.Button(), gr.Button()
    run.click(api.synthesize,
              [text, mode, voice, prompt_audio, prompt_text, instruction, seed, speed, fmt, steps, final, first_hop],
              result, api_name="synthesize", concurrency_limit=max_sessions, concurrency_id="synthesis")
    list_voices.click(api.voices, None, voices, api_name="voices", queue=False)
    save.click(api.save_voice, [name, prompt_audio, prompt_text], saved, api_name="save_voice")
