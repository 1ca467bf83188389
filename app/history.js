// CosyVoice3 Studio take history: the takes the workbench store keeps (GET workbench/api/takes), newest first.
// "This browser" lists the takes made on this page in this browser (its id lives in the cv-browser cookie, which
// every request of the page carries, so the history survives a reload and numbers go on from where they were);
// "All takes" adds the visitor's batch and API takes, and others' where the server shares them (COSYVOICE_SHARING,
// admin keys; cosyvoice/owners.py: a visitor never sees another's takes on a private server). Each view asks only for takes newer than the
// last it shows (?after=seq), so a new take never fetches the earlier ones again, and players load their audio
// only when played (preload="none").
window.cvHistory = (() => {
  const ZH = (navigator.language || "").startsWith("zh");
  const COOKIE = "cv-browser";
  const PAGE = 500;
  const POLL_MS = 5000; // "All takes" looks for new batch and API takes this often while it is shown
  const WORDS = {
    mine: ["This browser", "此浏览器"],
    all: ["All takes (batches, API, shared)", "全部录音（批量、API、共享）"],
    emptyMine: ["No takes yet: every take you generate is kept here (also after a reload), replayable and "
                + "downloadable.", "还没有录音：生成的每一条都会保留在这里（刷新后仍在），可重播和下载。"],
    emptyAll: ["No takes in the store yet.", "存储中还没有录音。"],
    take: ["Take", "第"],
    mode: ["mode", "模式"], voice: ["voice", "声音"], seed: ["seed", "种子"], speed: ["speed", "语速"],
    steps: ["steps", "步数"],
    streamed: ["streamed", "流式"], notStreamed: ["not streamed", "非流式"], stopped: ["stopped", "已停止"],
    row: ["row", "行"], condition: ["condition", "条件"],
    // where a take was made (the store's Take.source)
    "web UI": ["web UI", "网页"], batch: ["batch", "批量"], "long-form": ["long-form", "长文本"], API: ["API", "API"],
    reuseSeed: ["Use this seed", "使用此种子"], open: ["Use these settings", "使用这些设置"],
    // a take's mode as the page's tabs name it (the form's tab, else the service mode of a batch or API take)
    zero_shot: ["Zero-shot clone", "零样本克隆"], cross_lingual: ["Cross-lingual", "跨语种"],
    instruct2: ["Instruct", "指令控制"], instruct: ["Instruct", "指令控制"], sft: ["Saved voice", "已保存的声音"],
    failed: ["The history could not be loaded: ", "无法加载历史记录："],
  };
  const say = (key) => WORDS[key][ZH ? 1 : 0];
  const MODES = ["zero_shot", "cross_lingual", "instruct2", "instruct", "sft"];
  const modeName = (mode) => (MODES.includes(mode) ? say(mode) : mode);
  const views = {
    mine: { last: 0, count: 0, list: null, loaded: false },
    all: { last: 0, count: 0, list: null, loaded: false },
  };
  let shown = "mine";
  let running = null;
  let again = false;
  let timer = null;

  // The browser's id: made once (getRandomValues also works on plain-http pages, unlike randomUUID) and kept for
  // years; set as soon as this script runs, so the page's first event already carries it.
  function browserId() {
    const found = document.cookie.match(/(?:^|;\s*)cv-browser=([0-9a-f]{32})/);
    if (found) return found[1];
    const id = Array.from(crypto.getRandomValues(new Uint8Array(16)), (b) => b.toString(16).padStart(2, "0"))
      .join("");
    document.cookie = `${COOKIE}=${id}; path=/; max-age=${10 * 365 * 86400}; SameSite=Lax`;
    return id;
  }
  browserId();

  function base() {
    const root = (window.gradio_config && window.gradio_config.root) || "";
    return root.replace(/\/$/, "");
  }

  function el(tag, props = {}, ...children) {
    const node = Object.assign(document.createElement(tag), props);
    for (const child of children) node.append(child);
    return node;
  }

  function setSeed(seed) {
    const input = document.querySelector("#seed input");
    if (!input) return;
    input.value = String(seed);
    input.dispatchEvent(new Event("input", { bubbles: true }));
    input.dispatchEvent(new Event("change", { bubbles: true }));
  }

  function openTake(id) {
    api.opening = id;
    const holder = document.getElementById("open-take");
    const button = holder && (holder.tagName === "BUTTON" ? holder : holder.querySelector("button"));
    if (button) button.click();
  }

  function meta(take) {
    const p = take.provenance || {};
    const s = p.settings || {};
    const parts = [
      `${say("mode")} ${modeName(p.form_mode || p.mode || "")}`,
      `${say("voice")} ${p.voice_label || p.voice || p.voice_id || ""}`,
      `${say("seed")} ${p.seed}`,
      `${say("speed")} ${p.speed}`,
      ...(p.steps ? [`${say("steps")} ${p.steps}`] : []),  // takes made before steps were recorded have none
      s.stream ? say("streamed") : say("notStreamed"),
      String(s.format || "wav").toUpperCase(),
      `${Number(take.seconds).toFixed(1)} ${ZH ? "秒" : "s"}`,
    ];
    if (p.stopped) parts.push(say("stopped"));
    return parts.join(" · ");
  }

  function row(take, view) {
    const p = take.provenance || {};
    const audio = `${base()}/workbench/api/takes/${encodeURIComponent(take.id)}/audio`;
    const title = view === "mine"
      ? (ZH ? `${say("take")} ${views.mine.count} 条` : `${say("take")} ${views.mine.count}`)
      : [WORDS[take.source] ? say(take.source) : take.source, take.batch ? `${say("row")} ${take.row}` : "",
         take.label ? `${say("condition")} ${take.label}` : ""].filter(Boolean).join(" · ");
    const player = el("audio", { controls: true, preload: "none", src: audio, className: "take-audio" });
    const reuse = el("button", { type: "button", className: "reuse-seed", textContent: say("reuseSeed") });
    reuse.addEventListener("click", () => setSeed(p.seed));
    const open = el("button", { type: "button", className: "open-take", textContent: say("open") });
    open.addEventListener("click", () => openTake(take.id));
    // the take in the format it was made in (the store keeps WAV; the server encodes on the way out)
    const format = String((p.settings || {}).format || "wav").toLowerCase();
    const name = view === "mine" ? `take-${views.mine.count}-seed${p.seed}.${format}` : "";  // as the Download box
    const download = el("a", { href: `${audio}?format=${encodeURIComponent(format)}`, download: name,
                               textContent: format.toUpperCase(), className: "take-wav" });
    const text = el("blockquote", { className: "take-text" });
    text.textContent = (p.text || "").length > 300 ? `${p.text.slice(0, 299)}…` : (p.text || "");
    const node = el("div", { className: "take" },
      el("div", { className: "take-meta" }, el("strong", { textContent: title, title: take.batch || "" }), " — ",
        meta(take)),
      text, player, el("div", { className: "take-actions" }, reuse, open, download));
    node.dataset.take = take.id;
    node.dataset.seq = String(take.seq);
    return node;
  }

  function empty(view) {
    const list = views[view].list;
    const none = list.querySelector(".no-takes");
    if (views[view].count && none) none.remove();
    if (!views[view].count && !none) {
      list.append(el("p", { className: "no-takes", textContent: say(view === "mine" ? "emptyMine" : "emptyAll") }));
    }
  }

  async function load(view) {
    const v = views[view];
    for (;;) {
      const query = new URLSearchParams({ after: String(v.last), limit: String(PAGE) });
      if (view === "mine") query.set("mine", "true");
      const answer = await fetch(`${base()}/workbench/api/takes?${query}`, { credentials: "same-origin" });
      if (!answer.ok) throw new Error(`HTTP ${answer.status}`);
      const { takes, last } = await answer.json();
      for (const take of takes) {
        v.count += 1;
        v.list.prepend(row(take, view));
      }
      v.last = last;
      v.loaded = true;
      empty(view);
      if (view === "mine") {  // "Download all takes" (this browser's) once there is something to download
        const zip = document.getElementById("download-all");
        if (zip) zip.classList.toggle("cv-hidden", !v.count);
      }
      if (takes.length < PAGE) return;
    }
  }

  function build(root) {
    const bar = el("div", { className: "history-views", role: "group" });
    for (const view of ["mine", "all"]) {
      const button = el("button", { type: "button", className: "history-view", textContent: say(view) });
      button.dataset.view = view;
      button.setAttribute("aria-pressed", String(view === shown));
      button.addEventListener("click", () => api.show(view));
      bar.append(button);
      views[view].list = el("div", { className: "history-list" });
      views[view].list.dataset.view = view;
      views[view].list.hidden = view !== shown;
    }
    root.append(bar, el("p", { className: "history-error", hidden: true }), views.mine.list, views.all.list);
  }

  const api = {
    opening: "",
    browserId,
    // Called on page load: draws the panel once Gradio has rendered it, then loads this browser's takes.
    start() {
      const root = document.getElementById("take-history");
      if (!root) return void setTimeout(() => api.start(), 50);
      if (!root.childElementCount) build(root);
      return api.refresh();
    },
    // New takes of the shown view (after each take, and every few seconds while "All takes" is shown).
    async refresh() {
      if (!views[shown].list) return;
      if (running) {
        again = true;
        return running;
      }
      const root = document.getElementById("take-history");
      const error = root.querySelector(".history-error");
      running = (async () => {
        try {
          do {
            again = false;
            await load(shown);
          } while (again);
          error.hidden = true;
          root.dataset.state = "ready";
        } catch (err) {
          error.textContent = say("failed") + err.message;
          error.hidden = false;
          root.dataset.state = "failed";
        } finally {
          running = null;
        }
      })();
      return running;
    },
    show(view) {
      shown = view;
      for (const button of document.querySelectorAll("#take-history .history-view")) {
        button.setAttribute("aria-pressed", String(button.dataset.view === view));
      }
      for (const name of Object.keys(views)) views[name].list.hidden = name !== view;
      clearInterval(timer);
      if (view === "all") timer = setInterval(() => { if (!document.hidden) api.refresh(); }, POLL_MS);
      return api.refresh();
    },
  };
  // another tab of this browser may have made takes meanwhile: look when this one is shown again
  document.addEventListener("visibilitychange", () => { if (!document.hidden) api.refresh(); });
  return api;
})();
