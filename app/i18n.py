"""The page's words in English and Chinese; Gradio picks the table by the browser's language."""

from __future__ import annotations

import re
from collections.abc import Callable

import gradio as gr

from cosyvoice.bundle import DEFAULT_MODEL_ID, DEMO_WARNING, MODEL_IN_REPO  # the page names repository paths

EN = {
    "intro": "Fun-CosyVoice3-0.5B text-to-speech: clone a voice from a short recording, speak it in another "
             "language, or steer it with an instruction.",
    "more_tools": "Also here: [long-form narration and dialogue](/studio/longform) · [listening tests](/workbench/)",
    "precision": "What the model computes in on this server",
    "text": "Text to speak",
    "text_placeholder": "Type what the voice should say.",
    "zero_shot": "Zero-shot clone",
    "cross_lingual": "Cross-lingual",
    "instruct2": "Instruct",
    "transcript": "Transcript of the prompt recording",
    "transcript_info": "exactly what is said in the recording",
    "cross_lingual_note": "Speaks the text, in any language, with the voice; no transcript needed. Tags such "
                          "as [breath] or [laughter] work here.",
    "instruction": "Instruction",
    "voice": "Voice",
    "voice_info": "built-in and saved voices; a picked voice is used instead of a recording",
    "preview": "Voice preview",
    "prompt": "Prompt recording (upload or record)",
    "save_as": "Save this voice as",
    "save_placeholder": "a name",
    "save": "Save voice",
    "manage": "Manage voices",
    "rename_to": "New name",
    "rename": "Rename",
    "export": "Export",
    "export_file": "Exported voice file",
    "import": "Import a voice file",
    "delete": "Delete voice",
    "confirm_delete": "Yes, delete it",
    "cancel": "Cancel",
    "stream": "Stream (start playing at once)",
    "speed": "Speed",
    "seed": "Seed (-1: random)",
    "advanced": "Advanced settings",
    "steps": "Flow steps",
    "steps_info": "Euler steps of the flow model: fewer are faster and coarser (the model's default is 10)",
    "final": "Last flow call",
    "final_info": "full: attention over the whole utterance (the reference); chunked: over the new frames only, "
                  "faster on a CPU and constant per second, the last chunk differs",
    "final_full": "full (reference)",
    "final_chunked": "chunked",
    "first_hop": "First chunk (speech tokens)",
    "first_hop_info": "1 to 25; empty: the reference's 25; fewer start the sound sooner",
    "dice": "Random seed",
    "format": "Download format",
    "generate": "Generate",
    "stop": "Stop",
    "download": "Download",
    "history": "Takes",
    "download_all": "Download all takes (ZIP with text, voice, mode, seed, settings)",
    "import_as": "Import as (another name)",
    "import_again": "Import",
    "demo_banner": DEMO_WARNING,  # also what the log and the command lines say
}

ZH = {
    "intro": "Fun-CosyVoice3-0.5B 语音合成：用一段简短录音克隆声音、用另一种语言说话，或用指令控制说话方式。",
    "more_tools": "另有：[长文朗读与对话](/studio/longform) · [听音测试](/workbench/)",
    "precision": "本服务器上模型的计算精度",
    "text": "要朗读的文本",
    "text_placeholder": "输入要说的话。",
    "zero_shot": "零样本克隆",
    "cross_lingual": "跨语种",
    "instruct2": "指令控制",
    "transcript": "参考录音的文字内容",
    "transcript_info": "录音中说的每一个字",
    "cross_lingual_note": "用该声音朗读任何语言的文本，无需文字内容。可使用 [breath]、[laughter] 等标记。",
    "instruction": "指令",
    "voice": "声音",
    "voice_info": "内置与已保存的声音；选中后将代替录音使用",
    "preview": "试听声音",
    "prompt": "参考录音（上传或录制）",
    "save_as": "将此声音保存为",
    "save_placeholder": "名称",
    "save": "保存声音",
    "manage": "管理声音",
    "rename_to": "新名称",
    "rename": "重命名",
    "export": "导出",
    "export_file": "导出的声音文件",
    "import": "导入声音文件",
    "delete": "删除声音",
    "confirm_delete": "确定删除",
    "cancel": "取消",
    "stream": "流式播放（立即开始）",
    "speed": "语速",
    "seed": "随机种子（-1：随机）",
    "advanced": "高级设置",
    "steps": "流模型步数",
    "steps_info": "流模型的欧拉步数：步数越少越快，音质越粗（模型默认 10）",
    "final": "流模型的最后一次调用",
    "final_info": "完整：对整句做注意力（参考实现）；分块：只对新帧，CPU 上更快且每秒开销恒定，最后一块会不同",
    "final_full": "完整（参考实现）",
    "final_chunked": "分块",
    "first_hop": "首块（语音 token 数）",
    "first_hop_info": "1 到 25；留空：参考实现的 25；更少则更早出声",
    "dice": "随机种子",
    "format": "下载格式",
    "generate": "生成",
    "stop": "停止",
    "download": "下载",
    "history": "录音",
    "download_all": "下载全部录音（ZIP，含文本、声音、模式、种子与设置）",
    "import_as": "导入为（另一个名称）",
    "import_again": "导入",
    "demo_banner": "演示模式：未在 {model} 找到模型，当前界面运行的是一个随机初始化的微型模型，只会生成类似噪声的音频，"
                   "而不是语音。如需真实语音，请用 `modelscope download --model {model_id} --local_dir {model}` "
                   "下载模型（在仓库中执行 .venv/bin/pip install -e '.[download]'）后重启，或用 --model-dir DIR 启动。",
}

ZH["demo_banner"] = ZH["demo_banner"].format(model=MODEL_IN_REPO, model_id=DEFAULT_MODEL_ID)
I18N = gr.I18n(en=EN, zh=ZH, **{"zh-CN": ZH, "zh-TW": ZH})
t = I18N  # t("key") in component labels

# What the server says on the page (toasts, the status line, take details), by the browser's language: Gradio's
# I18n covers component labels only. Errors from the service keep their (English) detail behind a lead-in.
MESSAGES = {
    "busy": ("The server is busy: {detail}", "服务器繁忙：{detail}"),
    "invalid": ("{detail}", "输入有误：{detail}"),
    "denied": ("Not allowed: {detail}", "无权操作：{detail}"),
    "model": ("Model problem: {detail}", "模型出错：{detail}"),
    "unusable": ("This recording cannot be used: {detail}", "此录音无法使用：{detail}"),
    "expired": ("the uploaded recording is no longer on the server (uploads expire); upload it again",
                "上传的录音已过期，请重新上传"),
    "need_voice": ("upload or record a prompt voice ({low:g} to {high:g} s of speech), or pick a voice",
                   "请上传或录制一段参考录音（{low:g} 到 {high:g} 秒的语音），或选择一个声音"),
    "need_prompt": ("upload or record a prompt voice first, then save it under a name",
                    "请先上传或录制参考录音，再以一个名称保存"),
    "need_name": ("type a name for the voice", "请为声音输入名称"),
    "pick_rename": ("pick a saved voice to rename", "请选择要重命名的已保存声音"),
    "pick_export": ("pick a voice to export", "请选择要导出的声音"),
    "pick_delete": ("pick a saved voice to delete", "请选择要删除的已保存声音"),
    "not_voice_file": ("a voice file ends in {suffix} (made with Export)", "声音文件以 {suffix} 结尾（由“导出”生成）"),
    "name_taken": ("A voice named {name!r} exists already: type another name under “Import as” and press Import.",
                   "已存在名为 {name!r} 的声音：请在“导入为”中输入其他名称，然后点击“导入”。"),
    "saved": ("Saved voice {name!r}", "已保存声音 {name!r}"),
    "saved_no_transcript": ("Saved voice {name!r} (without transcript: cross-lingual and instruct)",
                            "已保存声音 {name!r}（无文字内容：可用于跨语种与指令控制）"),
    "renamed": ("Renamed to {name!r}", "已重命名为 {name!r}"),
    "imported": ("Imported voice {name!r}", "已导入声音 {name!r}"),
    "deleted": ("Deleted voice {name!r}", "已删除声音 {name!r}"),
    "ask_delete": ("Delete the voice **{name}**? This cannot be undone.", "删除声音 **{name}**？此操作无法撤销。"),
    "speed_not_streamed": ("this engine applies speed only without streaming: the take plays when it is complete",
                           "此引擎仅在非流式时调整语速：生成完成后播放"),
    "failed": ("Synthesis failed unexpectedly; the server log has the details.", "合成意外失败，详情见服务器日志。"),
    "stopped_before": ("Stopped before it started.", "已在开始前停止。"),
    "stopped": ("Stopped.", "已停止。"),
    "no_audio": ("The model produced no audio.", "模型没有生成音频。"),
    "generating": ("Generating… {seconds:.1f} s of audio (seed {seed})",
                   "生成中… 已生成 {seconds:.1f} 秒音频（种子 {seed}）"),
    "take_done": ("Take {number}: {seconds:.1f} s of audio in {wall:.1f} s",
                  "第 {number} 条：{wall:.1f} 秒内生成 {seconds:.1f} 秒音频"),
    "seed_voice": (" · seed {seed} · voice: {voice}", " · 种子 {seed} · 声音：{voice}"),
    "stopped_mark": (" · stopped", " · 已停止"),
    "not_kept": ("This take could not be kept in the history (the server's storage failed); download it now.",
                 "此条录音未能保存到历史记录（服务器存储出错）；请立即下载。"),
    "not_kept_read_only": ("This take is not kept in the history: this server keeps no takes (its data folder is "
                           "read-only); download it now.",
                           "此条录音未保存到历史记录：本服务器不保存录音（其数据文件夹为只读）；请立即下载。"),
    "voice_gone": ("The voice of that take is not in your voice list (an upload of another page, or deleted "
                   "since): pick a voice.",
                   "该录音所用的声音不在你的声音列表中（来自其他页面的上传，或已被删除）：请选择一个声音。"),
    "uploaded_recording": ("uploaded recording", "上传的录音"),
    "seed_range": ("the seed must be a whole number from 0 to {high} (or -1 for a random one)",
                   "种子必须是 0 到 {high} 之间的整数（或 -1 表示随机）"),
    "builtin": ("{label} (built-in)", "{label}（内置）"),
}


# The service's most common refusals in Chinese, matched on its (English) wording: a Chinese page shows these
# instead of the English detail; anything else keeps the English detail behind its Chinese lead-in.
_ZH_FIELDS = {"text": "要朗读的文本", "transcript": "文字内容", "instruction": "指令"}
_ZH_ACTIONS = {"rename": "重命名", "delete": "删除", "export": "导出"}
_ZH_EDITORS = {"the one who saved it": "保存它的人", "an administrator": "管理员"}
_ZH_SERVICE: tuple[tuple[re.Pattern[str], Callable[[re.Match[str]], str]], ...] = tuple(
    (re.compile(pattern), render) for pattern, render in (
        (r"^(text|transcript|instruction) is empty; type something to say$",
         lambda m: f"{_ZH_FIELDS[m[1]]}为空，请输入内容"),
        (r"^(text|transcript|instruction) has (\d+) characters; at most (\d+) are allowed per request",
         lambda m: f"{_ZH_FIELDS[m[1]]}有 {m[2]} 个字符，每次最多 {m[3]} 个；请分成几次生成"),
        (r"^instruct mode needs an instruction", lambda m: "指令控制模式需要一条指令，例如“请用平静的语气慢慢说。”"),
        (r"^zero-shot cloning needs the transcript of the prompt recording",
         lambda m: "零样本克隆需要参考录音的文字内容；或改用不需要文字内容的跨语种模式"),
        (r"^the transcript has only the system prompt", lambda m: "文字内容只有系统提示；请在其后写出参考录音中说的话"),
        (r"^\w+ needs a voice: ", lambda m: "需要一个声音：选择已保存的声音，或上传参考录音"),
        (r"^voice '(.*)' has no transcript, which zero-shot cloning needs",
         lambda m: f"声音 '{m[1]}' 没有文字内容，无法用于零样本克隆；请改用跨语种或指令控制模式"),
        (r"^unknown voice '(.*)'; saved voices: ", lambda m: f"没有名为 '{m[1]}' 的声音"),
        (r"^the prompt audio is ([\d.]+) s long; it must be at least ([\d.]+) s of speech$",
         lambda m: f"参考录音只有 {m[1]} 秒，至少需要 {m[2]} 秒的语音"),
        (r"^the prompt audio is (?:[\d.]+ s long|longer than [\d.]+ s); at most ([\d.]+) s is supported",
         lambda m: f"参考录音过长，最多支持 {m[1]} 秒（语音分词器的限制）；请剪成更短的片段"),
        (r"^the prompt audio is silent", lambda m: "参考录音没有声音；请录制语音，或调高输入音量"),
        (r"^the prompt audio is sampled at (\d+) Hz; it must be at least ([\d.]+) kHz",
         lambda m: f"参考录音的采样率为 {m[1]} Hz，至少需要 {m[2]} kHz"),
        (r"is not an audio file we can read", lambda m: "无法读取该音频文件；请上传 WAV、FLAC、MP3、OGG、WebM 或 M4A"),
        (r"^cannot decode .*: it looks like (\S+) but seems damaged or cut short",
         lambda m: f"无法解码：文件看起来是 {m[1]}，但似乎已损坏或不完整；请重新导出，或上传 WAV、FLAC、MP3 等格式"),
        (r"^speed must be between ([\d.]+) and ([\d.]+)", lambda m: f"语速必须在 {m[1]} 到 {m[2]} 之间"),
        (r"^steps must be an integer from (\d+) to (\d+)", lambda m: f"步数必须是 {m[1]} 到 {m[2]} 之间的整数"),
        (r"^busy: ", lambda m: "所有合成通道都在使用中，请稍后重试"),
        (r"^'(.*)' is a built-in voice and cannot be deleted", lambda m: f"'{m[1]}' 是内置声音，无法删除"),
        (r"^you may not (rename|delete|export) the voice '(.*)': only (the one who saved it|an administrator) may",
         lambda m: f"不能{_ZH_ACTIONS[m[1]]}声音 '{m[2]}'：只有{_ZH_EDITORS[m[3]]}可以"),
    ))


def service_detail(detail: str, zh: bool) -> str:
    """The detail of a service error as the page shows it: in Chinese where the page is and the wording is known."""
    if zh:
        for pattern, render in _ZH_SERVICE:
            if found := pattern.search(detail):
                return render(found)
    return detail


def say(zh: bool, key: str, **values: object) -> str:
    """A page message in English or Chinese, filled in."""
    return MESSAGES[key][1 if zh else 0].format(**values)
