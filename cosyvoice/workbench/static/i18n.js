// The workbench, rater, results and long-form pages in the browser's language, as the studio is: English as the
// pages are written, Chinese from the tables below (?lang=en or ?lang=zh overrides the browser). The pages stay
// written in English; every text node, placeholder, title and label is looked up when it appears (a
// MutationObserver follows what the scripts draw), whole strings first, then the patterns of strings with numbers.
// What the server says (error messages) stays as the server wrote it, and what users wrote (a test's title,
// instructions, labels) is never rewritten: the pages mark it translate="no", and nothing under such a mark is
// looked up (a title like "Start" stays "Start").
(() => {
  const asked = new URLSearchParams(location.search).get("lang");
  const lang = asked || (navigator.languages && navigator.languages[0]) || navigator.language || "en";
  window.wbLang = /^zh/i.test(lang) ? "zh" : "en";
  if (window.wbLang !== "zh") return;
  document.documentElement.lang = "zh-CN";

  const ZH = {
    // rater page
    "Listening test": "听音测试",
    "Instructions": "说明",
    "Use headphones in a quiet room. Each sample must be played to its end before your answer counts. Your answers are saved after every item: you can close the page and come back later, on any device, with your personal link (you get it before the first item).":
      "请在安静的房间里佩戴耳机。每个样本都要完整播放到结尾，您的回答才会计入。每一项回答后都会保存：您可以关闭页面，稍后用您的个人链接（在第一项之前给出）在任何设备上继续。",
    "Your personal link": "您的个人链接",
    "Keep this link: it is the only way back to your answers, in this browser or on any other device. Your name alone does not resume the test.":
      "请保存此链接：无论在本浏览器还是其他设备上，它都是回到您的回答的唯一途径。仅凭名字无法继续测试。",
    "Copy link": "复制链接",
    "Copied.": "已复制。",
    "Select the link and copy it.": "请选中链接并复制。",
    "Start the first item": "开始第一项",
    "Examples": "示例",
    "Listen to these labelled examples first: they show what to listen for. They are not rated.":
      "请先听这些带标注的示例：它们说明要注意听什么。示例不评分。",
    "Two last questions": "最后两个问题",
    "What did you listen with?": "您用什么设备收听？",
    "Headphones": "头戴式耳机", "Earbuds": "入耳式耳机", "Loudspeakers": "音箱",
    "A laptop's or phone's speaker": "笔记本电脑或手机的扬声器",
    "Your native language": "您的母语",
    "Send and finish": "提交并结束",
    "Choose what you listened with and enter your native language.": "请选择您的收听设备并填写您的母语。",
    "Your name": "您的名字",
    "Start": "开始",
    "· rating as": "· 评分人",
    "Loop": "循环",
    "Region from": "区间：从",
    "Play / pause": "播放 / 暂停",
    "↺ To the start": "↺ 回到开头",
    "❚❚ Pause": "❚❚ 暂停",
    "paused": "已暂停",
    "Keys: 1–9, A, B, X and R play that sample (switching keeps the position); space pauses and resumes. A sample counts as played to the end after one play from its start to its end: pausing is fine, a switch, a region or a jump are not. Replays count as extra listening.":
      "按键：1–9、A、B、X 和 R 播放对应样本（切换时保持播放位置）；空格键暂停和继续。一个样本从开头一次播放到结尾才算播放完整：暂停没有关系，切换样本、设定区间或跳转则不算。重放算作额外聆听。",
    "space": "空格键",
    "to": "到",
    "s": "秒",
    "start": "开始",
    "end": "结束",
    "Save and continue": "保存并继续",
    "Reconnecting to the server… your answer is kept on this device and will be saved as soon as the server answers again. Please keep this page open.":
      "正在重新连接服务器……您的回答已保存在本设备上，服务器恢复后会立即提交。请不要关闭此页面。",
    "Your personal link (bookmark it to continue on another device):": "您的个人链接（加入书签，可在其他设备上继续）：",
    "Thank you!": "谢谢！",
    "All": "全部",
    "answers are saved. You can close this page.": "条回答均已保存。您可以关闭此页面。",
    // the kinds' standard instructions (cosyvoice/workbench/listening.py DEFAULT_INSTRUCTIONS), as tests store them
    "Listen to both samples, A and B, to the end. Then choose the one that sounds better overall.":
      "请把 A、B 两个样本都听到结尾，然后选择整体听起来更好的一个。",
    "Listen to A, B and X to the end. X is the same recording as either A or B: say which.":
      "请把 A、B 和 X 都听到结尾。X 与 A 或 B 是同一段录音：请指出是哪一个。",
    "Listen to each sample to the end, then rate its overall quality: 5 Excellent, 4 Good, 3 Fair, 2 Poor, 1 Bad.":
      "请把每个样本听到结尾，然后为其整体质量打分：5 优，4 良，3 中，2 差，1 劣。",
    "Listen to A and B to the end, then say how B compares with A, from -3 (much worse) to +3 (much better); 0 means about the same.":
      "请把 A 和 B 听到结尾，然后评价 B 与 A 相比如何，从 -3（差很多）到 +3（好很多）；0 表示差不多。",
    "Listen to the reference and to every sample to the end. Rate each sample from 0 to 100 for how close it is to the reference; one of them is the reference itself.":
      "请把参考和每个样本都听到结尾。按与参考的接近程度为每个样本打 0 到 100 分；其中一个样本就是参考本身。",
    "Listen to every sample to the end. Rate each from 0 (bad) to 100 (excellent) for overall quality, comparing them with each other.":
      "请把每个样本都听到结尾。相互比较，为每个样本的整体质量打 0（很差）到 100（优秀）分。",
    "Which sample sounds better overall?": "哪个样本整体听起来更好？",
    "X is the same recording as A or as B. Which one?": "X 与 A 或 B 是同一段录音。是哪一个？",
    "How good is the overall quality of this sample?": "这个样本的整体质量如何？",
    "How does B compare with A?": "与 A 相比，B 如何？",
    "Rate each sample against the reference (0 bad … 100 identical to the reference).":
      "对照参考为每个样本打分（0 很差 … 100 与参考完全相同）。",
    "Rate each sample's overall quality (0 bad … 100 excellent).": "为每个样本的整体质量打分（0 很差 … 100 优秀）。",
    "5 Excellent": "5 优", "4 Good": "4 良", "3 Fair": "3 中", "2 Poor": "2 差", "1 Bad": "1 劣",
    "-3 much worse": "-3 差很多", "-2 worse": "-2 较差", "-1 slightly worse": "-1 略差", "0 about the same": "0 差不多",
    "+1 slightly better": "+1 略好", "+2 better": "+2 较好", "+3 much better": "+3 好很多",
    "Excellent": "优", "Good": "良", "Fair": "中", "Poor": "差", "Bad": "劣",
    "A is better": "A 更好", "B is better": "B 更好", "No preference": "没有偏好",
    "X is A": "X 是 A", "X is B": "X 是 B",
    "Reference": "参考", "Sample": "样本",
    "▶ Play": "▶ 播放",
    "not played yet": "尚未播放",
    "playing…": "播放中……",
    "playing a segment…": "播放片段中……",
    "✓ played to the end": "✓ 已播放到结尾",
    "not rated": "未评分",
    "click to confirm this value": "点击确认此分值",
    "Play every sample to the end first.": "请先把每个样本播放到结尾。",
    "Choose an answer.": "请选择一个答案。",
    // workbench owner page
    "Listening-test workbench": "听音测试工作台",
    "Make takes in batches (each with its provenance), build blind tests from them, send raters their link, read the results.":
      "批量生成录音（每条都带有来源记录），用它们构建盲测，把链接发给评分人，查看结果。",
    "← Studio": "← 工作室",
    "Long-form": "长文本",
    "Takes made by the batch CLI, or over REST without a key, on the server's machine are not shown here: on this server each visitor sees only what they made. To see them, run the web UI or REST server on that machine bound to 127.0.0.1 (the default) without API keys, or set COSYVOICE_SHARING=team; or run the same file with \"Run batch\" above.":
      "服务器所在机器上用批处理命令行或不带密钥的 REST 生成的录音不在这里显示：在此服务器上，每位访客只能看到自己生成的内容。要看到它们，请在那台机器上以 127.0.0.1（默认）且不设 API 密钥运行网页界面或 REST 服务器，或设置 COSYVOICE_SHARING=team；也可以用上面的“运行批处理”运行同一文件。",
    "batch": "批次",
    "state": "状态",
    "rows": "行",
    "Resume": "继续",
    "waiting": "等待中",
    "stopped": "已停止",
    "interrupted: its server stopped": "已中断：其服务器停止了",
    "The server does not answer (restarting?); trying again every second…": "服务器没有响应（正在重启？）；每秒重试一次……",
    "The server does not answer: check that it is running, then try again.": "服务器没有响应：请确认它在运行，然后重试。",
    "1. Batch takes": "1. 批量生成",
    "A CSV (header": "CSV 文件（表头",
    "; only text and voice are needed) or JSONL file.": "；只有 text 和 voice 是必需的）或 JSONL 文件。",
    "is a saved voice's id or name (built-ins included);": "是已保存声音的 id 或名称（包括内置声音）；",
    "the flow's Euler steps (default 10; fewer are faster and coarser);": "是流模型的欧拉步数（默认 10；越少越快、越粗糙）；",
    "must be the one this server runs (the batch CLI runs several);": "必须是此服务器运行的精度（批处理命令行可运行多种）；",
    "is the condition a row belongs to.": "是该行所属的条件。",
    "Run batch": "运行批处理",
    "…or texts × voices × speeds (one take each; the label is the voice, plus the speed when several are given):":
      "……或 文本 × 声音 × 语速（每个组合一条录音；标签为声音名，给出多个语速时再加上语速）：",
    "one text per line": "每行一段文本",
    "Voices": "声音",
    "Speeds": "语速",
    "Run texts × voices × speeds": "运行 文本 × 声音 × 语速",
    "4. Takes": "4. 录音",
    "Batch": "批次",
    "Label": "标签",
    "Text contains": "文本包含",
    "(any)": "（任意）",
    "← Newer": "← 较新",
    "Older →": "较旧 →",
    "no takes": "没有录音",
    "(one row per take with its provenance)": "（每条录音一行，附来源记录）",
    "take": "录音",
    "text (normalised)": "文本（规范化后）",
    "voice · mode · seed": "声音 · 模式 · 种子",
    "length": "时长",
    "listen": "试听",
    "2. New blind test": "2. 新建盲测",
    "Kind": "类型",
    "A/B preference": "A/B 偏好",
    "ABX (can listeners tell two conditions apart?)": "ABX（听者能否区分两个条件？）",
    "MOS (ACR 1–5)": "MOS（ACR 1–5）",
    "CMOS (−3..+3 vs a reference)": "CMOS（与参考比较，−3..+3）",
    "MUSHRA (hidden reference + anchor)": "MUSHRA（隐藏参考 + 锚点）",
    "MUSHRA without reference": "无参考 MUSHRA",
    "Title": "标题",
    "Name (only you see it)": "名称（仅您可见）",
    "AB sysA vs sysB": "AB：sysA 对 sysB",
    "Title raters see": "评分人看到的标题",
    "Raters see only the title and the instructions below, never the name, the conditions or the systems compared.":
      "评分人只能看到标题和下面的说明，看不到名称、条件或所比较的系统。",
    "Conditions (take labels) to compare:": "要比较的条件（录音标签）：",
    "Anchor / attention check": "锚点 / 注意力检查",
    "allow \"no preference\" (A/B)": "允许“没有偏好”（A/B）",
    "Instructions for raters (empty: the standard wording of the kind)": "给评分人的说明（留空：使用该类型的标准说明）",
    "Training examples raters hear before the first item (optional), one per line: take id = what it shows":
      "评分人在第一项之前听的训练示例（可选），每行一个：录音 id = 它示范的内容",
    "ask each rater at the end what they listened with and their native language (raters.csv)":
      "结束时询问每位评分人使用的收听设备和母语（raters.csv）",
    "Create test": "创建测试",
    "Items per rater": "每位评分人的项数",
    "At most": "最多",
    "raters": "位评分人",
    "(0: all items, no cap; a subset is drawn per rater so every condition is heard equally often)":
      "（0：全部项目、不限人数；为每位评分人抽取子集，使每个条件被听到的次数相同）",
    "…or import a design (JSON)": "……或导入设计（JSON）",
    "design": "设计",
    "Close": "关闭",
    "Open again": "重新开放",
    "closed": "已关闭",
    "3. Tests": "3. 测试",
    "test": "测试",
    "kind": "类型",
    "items": "项数",
    "raters (answered / total)": "评分人（已答 / 总数）",
    "links": "链接",
    "rater link": "评分链接",
    "results": "结果",
    "none yet": "暂无",
    "(none)": "（无）",
    "Choose a CSV or JSONL file first.": "请先选择 CSV 或 JSONL 文件。",
    "Give at least one text and one voice.": "请至少给出一段文本和一个声音。",
    // results page
    "Test results": "测试结果",
    "← workbench": "← 工作台",
    "Results": "结果",
    "Raters": "评分人",
    "Rater link:": "评分链接：",
    "rater": "评分人",
    "progress": "进度",
    "attention checks failed": "未通过的注意力检查",
    "seed": "种子",
    "Summary": "汇总",
    "Download answers.csv": "下载 answers.csv",
    "(one row per answer: test, rater, item, take ids, conditions, answer, time spent, play count, attention check, the rater's screening flags)":
      "（每个回答一行：测试、评分人、项目、录音 id、条件、回答、用时、播放次数、注意力检查、评分人的筛查标记）",
    "Studio": "工作室",
    "screening": "筛查",
    "accepted": "已接受",
    "Leave the raters screening flagged out of the statistics": "统计时排除被筛查标记的评分人",
    // the screening rules (cosyvoice/workbench/screening.py RULES)
    "rated the hidden reference below 90 on more than 15% of items": "在超过 15% 的项目中给隐藏参考的评分低于 90",
    "rated the mid anchor above 90 on more than 15% of items": "在超过 15% 的项目中给中间锚点的评分高于 90",
    "failed an attention-check (gold) item": "未通过注意力检查（黄金）项目",
    "ratings vary too little (variance on a 1–5 scale below 0.15)": "评分变化太小（1–5 分制下方差低于 0.15）",
    "has not answered every item": "尚未回答所有项目",
    "No such test": "没有这个测试",
    "This link names no test you can see: it may be mistyped, the test deleted, or it belongs to another visitor (only a test's owner sees its results). Your own tests are listed on the workbench.":
      "此链接没有指向您可以查看的测试：链接可能有误、测试已删除，或者它属于另一位访客（只有测试的所有者能看到结果）。您自己的测试列在工作台上。",
    "Download raters.csv": "下载 raters.csv",
    "(one row per rater: answered, listening device, native language)": "（每位评分人一行：已答数、收听设备、母语）",
    "Per rater": "按评分人",
    "Objective scorecard": "客观评分卡",
    "Speaker similarity, predicted quality, duration and loudness per condition, computed on this machine from the takes (no listener). With the demo model these numbers mean nothing.":
      "各条件的说话人相似度、预测质量、时长和响度，由本机根据录音计算（无需听者）。使用演示模型时这些数字没有意义。",
    "Compute scorecard": "计算评分卡",
    "computing…": "计算中……",
    "(per take)": "（每条录音）",
    "Not enough answers for intervals yet.": "回答还不足以计算置信区间。",
    "mean with 95% t-interval": "均值及 95% t 区间",
    "Bradley–Terry log-strength, 95% interval (ranked by lower bound)": "Bradley–Terry 对数强度，95% 区间（按下界排序）",
    "pair": "配对", "wins": "胜场", "no preference": "没有偏好", "share of first": "前者占比",
    "binomial p (two-sided)": "二项检验 p（双侧）",
    "X named correctly": "正确识别 X",
    "share": "占比",
    "binomial p (one-sided: better than guessing)": "二项检验 p（单侧：优于猜测）",
    "correct": "正确",
    "chose": "选择", "times": "次数", "condition": "条件", "mean": "均值", "95% CI": "95% 置信区间",
    "hidden reference": "隐藏参考",
    // the scorecard's note (cosyvoice/workbench/scorecard.py NOTE)
    "Objective measures, no listener: duration, level (RMS/peak dBFS), speaker similarity to the prompt (cosine; CAM++ from the model bundle, Resemblyzer if installed) and DNSMOS P.835 (1-5). With the demo model these numbers mean nothing.":
      "客观指标，无需听者：时长、电平（RMS/峰值 dBFS）、与参考录音的说话人相似度（余弦；CAM++ 来自模型包，已安装 Resemblyzer 时也用它）和 DNSMOS P.835（1-5）。使用演示模型时这些数字没有意义。",
    "takes": "录音数", "length s": "时长（秒）", "peak dBFS": "峰值 dBFS",
    "similarity (CAM++)": "相似度（CAM++）", "similarity (Resemblyzer)": "相似度（Resemblyzer）",
    "DNSMOS signal": "DNSMOS 语音", "DNSMOS background": "DNSMOS 背景", "DNSMOS overall": "DNSMOS 总体",
    // long-form page
    "Long-form projects · CosyVoice3 Studio": "长文本项目 · CosyVoice3 Studio",
    "Long-form projects": "长文本项目",
    "back to the studio": "返回工作室",
    "Projects": "项目",
    "Project": "项目",
    "Open": "打开",
    "Delete": "删除",
    "New project": "新建项目",
    "Name": "名称",
    "My article": "我的文章",
    "Narration": "旁白",
    "Dialogue (Name: line)": "对话（名字: 台词）",
    "Voice": "声音",
    "Loudness": "响度",
    "podcast −16 LUFS": "播客 −16 LUFS",
    "broadcast −23 LUFS": "广播 −23 LUFS",
    "audiobook (ACX)": "有声书（ACX）",
    "unchanged": "不变",
    "or a file (.txt .md .epub .pdf .docx)": "或一个文件（.txt .md .epub .pdf .docx）",
    "Speakers (dialogue: one per line,": "说话人（对话：每行一个，",
    "Text (paragraphs: blank lines; chapters:": "文本（段落：空行分隔；章节：",
    "; pauses:": "；停顿：",
    "; dialogue:": "；对话：",
    "or": "或",
    "Create project": "创建项目",
    "podcast −16 LUFS / −1 dBTP": "播客 −16 LUFS / −1 dBTP",
    "broadcast −23 LUFS / −1 dBTP": "广播 −23 LUFS / −1 dBTP",
    "audiobook (ACX: −20 dB RMS / −3.5 dB peak)": "有声书（ACX：−20 dB RMS / −3.5 dB 峰值）",
    "Margin s": "边距（秒）",
    "Retries": "重试次数",
    "a take that sounds wrong (far too long or short, looping, at the model's length limit) is made again with a new seed this many times; every take is kept":
      "听起来有问题的录音（过长或过短、循环、达到模型长度上限）会用新种子重新生成这么多次；每条录音都会保留",
    "Sentence s": "句间（秒）",
    "Paragraph s": "段间（秒）",
    "Chapter s": "章间（秒）",
    "Turn s": "轮次间（秒）",
    "Save settings": "保存设置",
    "Generate": "生成",
    "Stop": "停止",
    "play the chosen takes in order, with their pauses, as they are made": "按顺序播放选定的录音（含停顿），边生成边播放",
    "Play all": "全部播放",
    "Stop playing": "停止播放",
    "Status": "状态",
    "Text": "文本",
    "Instruction": "指令",
    "Speed": "语速",
    "Pause s": "停顿（秒）",
    "Take": "录音",
    "Export": "导出",
    "Finishing": "后期处理",
    "trimmed + levelled": "修剪 + 响度统一",
    "raw takes": "原始录音",
    "Audiobook delivery (ACX)": "有声书交付（ACX）",
    "one MP3 a chapter: 192 kbps CBR, 44.1 kHz, mono, 0.5–1 s of room tone at the head and 1–5 s at the tail, at most 120 minutes; RMS −23 to −18 dB, peak ≤ −3 dB, noise floor ≤ −60 dB":
      "每章一个 MP3：192 kbps CBR、44.1 kHz、单声道，开头 0.5–1 秒、结尾 1–5 秒的房间底噪，每个文件最长 120 分钟；RMS −23 至 −18 dB，峰值 ≤ −3 dB，底噪 ≤ −60 dB",
    "Book title": "书名",
    "Author": "作者",
    "Narrator": "朗读者",
    "Save book details": "保存图书信息",
    "Cover (JPEG or PNG)": "封面（JPEG 或 PNG）",
    "cover set": "已设置封面",
    "no cover": "无封面",
    "Remove cover": "移除封面",
    "cover saved": "封面已保存",
    "book details saved: the next export and delivery carry them": "图书信息已保存：之后的导出和交付都会带上",
    "Make and check the files": "生成并检查文件",
    "makes the chapter files and checks each file as ACX will": "生成各章文件，并像 ACX 一样逐个检查",
    "Download for ACX": "下载 ACX 交付文件",
    "Master to ACX": "按 ACX 母带处理",
    "File": "文件",
    "Format": "格式",
    "Head / tail s": "开头 / 结尾（秒）",
    "making the files…": "正在生成文件……",
    "exporting…": "正在导出……",
    "waiting for the project's other jobs…": "正在等待本项目的其他任务……",
    "Length": "时长",
    "RMS dB": "RMS dB",
    "Peak dB": "峰值 dB",
    "Noise floor dB": "底噪 dB",
    "Result": "结果",
    "passes": "通过",
    "meets ACX": "符合 ACX",
    "does not meet ACX": "不符合 ACX",
    "silence": "静音",
    "mastered to ACX: the export now uses the audiobook preset": "已按 ACX 处理：导出将使用有声书预设",
    "settings saved": "设置已保存",
    "Delete this project and its takes? Takes a listening test uses stay in the workbench.":
      "删除此项目及其录音？听测使用的录音会保留在工作台中。",
    "(no takes)": "（无录音）",
    "(none chosen)": "（未选择）",
    "new take with a new seed": "用新种子生成新录音",
    "split at the cursor": "在光标处拆分",
    "merge with the next segment": "与下一段合并",
    "place the cursor in the text where it should be split": "请把光标放在文本中要拆分的位置",
    "the browser refused to play audio": "浏览器拒绝播放音频",
    "Regenerate": "重新生成", "Split": "拆分", "Merge ↓": "合并 ↓",
    "make this segment's take now": "现在生成这一段的录音",
    "silent": "无声",
    "No voice was mapped in Speakers for": "“说话人”中没有为以下说话人指定声音：",
    "; they read with": "；他们将使用",
    "the project's voice": "项目的声音",
    "(pick another in each segment's Voice)": "（可在每段的“声音”中另选）",
    "pending": "待生成", "queued": "排队中", "running": "生成中", "done": "完成", "failed": "失败",
    " (built-in)": "（内置）",
  };
  const PATTERNS = [
    [/^Item (\d+) of (\d+)$/, "第 $1 项，共 $2 项"],
    [/^Sample (\S+)$/, "样本 $1"],
    [/^([\d.]+) \/ ([\d.]+) s$/, "$1 / $2 秒"],
    [/^(\d+) (Excellent|Good|Fair|Poor|Bad)$/, (m, n, b) => `${n} ${ZH[b]}`],
    [/^Move every slider to your rating \((\d+) not rated yet; click a value to keep it as it is\)\.$/,
     "请把每个滑块拖到您的评分（还有 $1 个未评分；点击分值可保留当前值）。"],
    [/^Created with (\d+) items\. Send raters $/, "已创建，共 $1 项。把此链接发给评分人："],
    [/^(\d+) of (\d+) rows$/, "$1 / $2 行"],
    [/^Started: (\d+) rows\.$/, "已开始：$1 行。"],
    [/^(\d+) items$/, "$1 项"],
    [/^at most (\d+)$/, "最多 $1 人"],
    [/^(\d+) of (\d+) raters flagged$/, "$2 位评分人中 $1 位被标记"],
    [/^, about (\d+) s left$/, "，约剩 $1 秒"],
    [/^(.*) \((\w+), (\d+) items\)$/, "$1（$2，$3 项）"],
    [/^(\d+) of (\d+)$/, "$1 / $2"],
    [/^(\d+)–(\d+) of (\d+)$/, "第 $1–$2 条，共 $3 条"],
    [/^raters see: (.*)$/, "评分人看到：$1"],
    [/^Agreement: (.*) = (.*) over (\d+) raters$/, "一致性：$1 = $2（$3 位评分人）"],
    [/^(\d+) of (\d+) segments done$/, "已完成 $1 / $2 段"],
    [/^, (\d+) failed$/, "，$1 段失败"],
    [/^ · generating$/, " · 生成中"],
    [/^ · about (\d+) s left$/, " · 约剩 $1 秒"],
    [/^playing (\d+) of (\d+)$/, "正在播放 $1 / $2"],
    [/^waiting for segment (\d+)$/, "等待第 $1 段"],
    [/^take (\d+) · seed (\d+) · ([\d.]+) s( · old text)?( · suspect)?$/,
     (m, n, seed, s, old, suspect) => `录音 ${n} · 种子 ${seed} · ${s} 秒${old ? " · 旧文本" : ""}${suspect ? " · 可疑" : ""}`],
    [/^project created: (\d+) segments$/, "项目已创建：$1 段"],
    [/^(\d+) take\(s\) kept in the workbench: listening tests use them$/, "$1 条录音保留在工作台中：听测在使用它们"],
    [/^exported (.+)$/, "已导出 $1"],
    [/^the export was (\w+); ask for it again$/, "导出未完成（$1），请重新导出"],
    [/^(MP3 \S+ kbps(?: CBR)?), (\S+) Hz, (mono|stereo)$/, (m, f, hz, ch) => `${f}，${hz} Hz，${ch === "mono" ? "单声道" : "立体声"}`],
    [/^Chapter: (.+)$/, "章节：$1"],
    // a segment's reasons to listen again (cosyvoice/longform/finishing.py), one a line
    [/^too long: ([\d.]+) s for about ([\d.]+) s of text$/, "过长：$1 秒，文本约 $2 秒"],
    [/^too short: ([\d.]+) s for about ([\d.]+) s of text$/, "过短：$1 秒，文本约 $2 秒"],
    [/^a ([\d.]+) s silence inside$/, "中间有 $1 秒静音"],
    [/^([\d.]+) s of silence before the speech$/, "语音前有 $1 秒静音"],
    [/^clipping: ([\d.]+)% of samples at full scale$/, "削波：$1% 的采样达到满幅"],
    [/^the speech loops: (\d+) token\(s\) said (\d+) times from ([\d.]+) s$/,
     "语音在循环：$1 个语音单元从 $3 秒起重复了 $2 次"],
    [/^ran to the model's length limit \((\d+) speech tokens for (\d+) text tokens\)$/,
     "达到模型的长度上限（$1 个语音单元，$2 个文本单元）"],
    [/^stopped at the model's shortest length \((\d+) speech tokens for (\d+) text tokens\)$/,
     "停在模型的最短长度（$1 个语音单元，$2 个文本单元）"],
    [/^using take (\d+) of (\d+); (\d+) sounded wrong$/, "使用第 $1 条录音（共 $2 条）；$3 条听起来有问题"],
    [/^last attempt failed: (.+)$/, "上次生成失败：$1"],
    [/^(.+) \(built-in\)$/, "$1（内置）"],
  ];

  function translate(text) {
    const core = text.trim().replace(/\s+/g, " ");
    if (!core) return text;
    let out = Object.prototype.hasOwnProperty.call(ZH, core) ? ZH[core] : null;
    for (const [pattern, replacement] of out === null ? PATTERNS : []) {
      if (pattern.test(core)) { out = core.replace(pattern, replacement); break; }
    }
    if (out === null) {
      if (Object.prototype.hasOwnProperty.call(ZH, text)) return ZH[text];  // a string whose spaces matter
      for (const [pattern, replacement] of PATTERNS) if (pattern.test(text)) return text.replace(pattern, replacement);
      return text;
    }
    const lead = text.match(/^\s*/)[0], trail = text.match(/\s*$/)[0];
    return lead + out + trail;
  }

  const SKIP = new Set(["SCRIPT", "STYLE", "TEXTAREA", "CODE"]);
  // what a person typed or named (a voice, a speaker, a test's title) is marked translate="no" (HTML's own
  // attribute): it is shown as they wrote it, even where it reads like one of the page's strings
  const kept = (element) => element && element.closest("[translate=no]");
  function visit(node) {
    if (node.nodeType === Node.TEXT_NODE) {
      if (node.parentNode && SKIP.has(node.parentNode.nodeName) || kept(node.parentElement)) return;
      const done = translate(node.data);
      if (done !== node.data) node.data = done;
      return;
    }
    if (node.nodeType !== Node.ELEMENT_NODE || kept(node)) return;
    for (const attr of ["placeholder", "title", "aria-label"]) {
      const value = node.getAttribute(attr);
      if (value) {
        const done = translate(value);
        if (done !== value) node.setAttribute(attr, done);
      }
    }
    if (!SKIP.has(node.nodeName)) for (const child of node.childNodes) visit(child);
  }

  const start = () => {
    visit(document.body);
    document.title = translate(document.title);
    new MutationObserver((changes) => {
      for (const change of changes) {
        if (change.type === "characterData") visit(change.target);
        else if (change.type === "attributes") visit(change.target);
        else change.addedNodes.forEach(visit);
      }
      const title = kept(document.querySelector("title")) ? document.title : translate(document.title);
      if (title !== document.title) document.title = title;
    }).observe(document.body, {childList: true, subtree: true, characterData: true, attributes: true,
                               attributeFilter: ["placeholder", "title", "aria-label"]});
  };
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
