// CosyVoice3 Studio live player: reads a take's PCM16 chunks (WebSocket studio/live/<id>) and schedules each
// piece on an AudioContext right after the previous one, so playback starts with the first chunk and has no
// gaps unless the audio arrives later than it plays. window.cvStudio.takes keeps each take's timings
// (epoch milliseconds) for the page's status line and the browser tests.
window.cvStudio = (() => {
  const ZH = (navigator.language || "").startsWith("zh");
  const LEAD_S = 0.02; // scheduling margin for the first piece and after a stall
  // What the player line says; a failure names its cause (the take itself is still made and kept).
  const KEPT = [" The take is still made: play it from the history below when it is done.",
                "该条音频仍会生成：完成后可在下方历史记录中播放。"];
  const WORDS = {
    waiting: ["generating…", "生成中…"],
    playing: ["playing, first sound {s} s after the click", "正在播放，点击后 {s} 秒出声"],
    done: ["played, first sound {s} s after the click", "已播放，点击后 {s} 秒出声"],
    playing_waited: ["playing, first sound {s} s after its turn came ({w} s in line before it)",
                     "正在播放，轮到后 {s} 秒出声（此前排队 {w} 秒）"],
    done_waited: ["played, first sound {s} s after its turn came ({w} s in line before it)",
                  "已播放，轮到后 {s} 秒出声（此前排队 {w} 秒）"],
    stopped: ["stopped", "已停止"],
    no_websockets: ["Live playback is off: this server cannot accept WebSockets (its Python lacks the "
                    + "websockets package; install the web UI with scripts/webui.sh).",
                    "实时播放不可用：服务器无法接受 WebSocket 连接（其 Python 缺少 websockets 包；请用 "
                    + "scripts/webui.sh 安装网页界面）。"],
    not_opened: ["Live playback failed: the live-audio connection (a WebSocket to /studio/live) could not be "
                 + "opened; a proxy or firewall may block WebSockets.",
                 "实时播放失败：无法打开实时音频连接（到 /studio/live 的 WebSocket）；代理或防火墙可能阻止了 WebSocket。"],
    lost: ["Live playback failed: the live-audio connection was lost (WebSocket close code {code}).",
           "实时播放失败：实时音频连接中断（WebSocket 关闭代码 {code}）。"],
  };
  const say = (key, values = {}) =>
    WORDS[key][ZH ? 1 : 0].replace(/\{(\w+)\}/g, (_, name) => String(values[name]));
  const liveOff = () => window.cvLive && window.cvLive.websockets === false;
  let ctx = null;
  let current = null;
  const takes = {};
  const now = () => performance.timeOrigin + performance.now();

  function base() {
    const root = (window.gradio_config && window.gradio_config.root) || "";
    return root.replace(/\/$/, "");
  }

  function show(state, text) {
    const el = document.getElementById("live-player");
    if (!el) return;
    el.dataset.state = state;
    el.setAttribute("role", state === "failed" ? "alert" : "status");
    const label = el.querySelector(".live-text");
    if (label) label.textContent = text;
  }

  const WAITED_S = 1.0;  // a take that waited in line this long has its wait said apart from its first sound
  // The first sound's words: from the click, or, after a wait in line, from when the take's turn came (the
  // engine's latency) with the wait beside it, so a busy server's queue is not read as a slow model.
  function soundWords(key, take) {
    const waited = take.turnAt === null ? 0 : (take.turnAt - take.clickAt) / 1000;
    if (waited < WAITED_S) return say(key, { s: ((take.firstSoundAt - take.clickAt) / 1000).toFixed(2) });
    return say(key + "_waited", { s: ((take.firstSoundAt - take.turnAt) / 1000).toFixed(2), w: waited.toFixed(1) });
  }

  function context(rate) {
    if (!ctx || ctx.state === "closed") {
      ctx = new AudioContext({ latencyHint: "interactive", sampleRate: rate });
    }
    ctx.resume();
    return ctx;
  }

  function schedule(take, samples) {
    const buffer = ctx.createBuffer(1, samples.length, take.rate);
    const channel = buffer.getChannelData(0);
    for (let i = 0; i < samples.length; i++) channel[i] = samples[i] / 32768;
    const source = ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(ctx.destination);
    const t = ctx.currentTime;
    if (take.next < t + 0.002) {
      if (take.sources.length) {
        take.stalls += 1;
        take.gapsMs.push(Math.round((t + LEAD_S - take.next) * 1000));
      }
      take.next = t + LEAD_S;
    }
    source.start(take.next);
    if (take.firstSoundAt === null) {
      const latency = ctx.outputLatency || ctx.baseLatency || 0;
      take.firstSoundAt = now() + (take.next - t + latency) * 1000;
      take.state = "playing";
      show("playing", soundWords("playing", take));
    }
    take.next += buffer.duration;
    take.samples += samples.length;
    take.sources.push(source);
    source.onended = () => {
      if (take.streamDone && source === take.sources[take.sources.length - 1]) finish(take, "done");
    };
  }

  // ``problem``: why playback failed (a WORDS key and its values), said with the take's fate
  function finish(take, state, problem = null) {
    if (take.endAt !== null) return;
    take.endAt = now();
    take.state = state;
    if (problem) take.problem = problem[0];
    if (current !== take) return;
    if (state === "failed") show("failed", say(...problem) + KEPT[ZH ? 1 : 0]);
    else if (state === "done") show("idle", take.firstSoundAt === null ? "" : soundWords("done", take));
    else show(state, say(state));
  }

  function run(take) {
    if (liveOff()) return finish(take, "failed", ["no_websockets"]);
    const url = new URL(`${base()}/studio/live/${take.id}`, window.location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(url);
    socket.binaryType = "arraybuffer";
    take.socket = socket;
    socket.onopen = () => { take.opened = true; };
    socket.onmessage = (event) => {
      if (typeof event.data === "string") {  // the header: {"sample_rate": N}
        take.rate = JSON.parse(event.data).sample_rate || take.rate;
        return;
      }
      if (take.firstByteAt === null) take.firstByteAt = now();
      if (event.data.byteLength) schedule(take, new Int16Array(event.data));
    };
    socket.onclose = (event) => {
      if (take.stopped) return finish(take, "stopped");
      if (event.code !== 1000) {
        return finish(take, "failed", take.opened ? ["lost", { code: event.code }] : ["not_opened"]);
      }
      take.streamDone = true;
      if (!take.sources.length || ctx.currentTime >= take.next) finish(take, "done");
    };
  }

  return {
    takes,
    // A new take: called on the Generate click (a user gesture, so the AudioContext may start).
    begin(rate) {
      this.stop();
      // not randomUUID: that exists only on https:// and localhost pages, and the studio may be served over http
      const id = Array.from(crypto.getRandomValues(new Uint8Array(16)), (b) => b.toString(16).padStart(2, "0")).join("");
      const take = {
        id, rate, clickAt: now(), turnAt: null, firstByteAt: null, firstSoundAt: null, endAt: null, state: "waiting",
        stalls: 0, gapsMs: [], samples: 0, next: 0, sources: [], streamDone: false, stopped: false,
        socket: null, opened: false, problem: null,
      };
      takes[id] = take;
      current = take;
      context(rate);
      show("waiting", say("waiting"));
      run(take);
      return id;
    },
    // Stop the current take's playback; returns its id (the server stops it too), "" when there is none.
    stop() {
      const take = current;
      if (!take) return "";
      window.cvQueue.forget(take.id);
      if (take.endAt !== null) return take.id;
      take.stopped = true;
      if (take.socket) take.socket.close();
      for (const source of take.sources) {
        try { source.stop(); } catch (err) { /* not started yet */ }
      }
      finish(take, "stopped");
      return take.id;
    },
    current() {
      return current ? current.id : "";
    },
    // The server began the take (its turn in the queue came): the first sound is counted from here.
    turn(id) {
      const take = takes[id];
      if (take && take.turnAt === null) take.turnAt = now();
    },
    summary(id) {
      const t = takes[id];
      if (!t) return null;
      const { socket, sources, ...plain } = t;
      return plain;
    },
  };
})();

// A waiting take's place in Gradio's queue, in words ("waiting: 2nd in line"), on the line #queue-place. Gradio
// sends each event's place over the session's event stream (its queue protocol's "estimation" messages) and
// draws it as "queue: 2/2 | 0.6s", which the page hides (show_progress="hidden"). This reads the same stream:
// the join request names the take (its first input is the take id) and its answer the event id; a copy of the
// stream's body is read here, the original goes to Gradio untouched.
//
// The same reading keeps every click's answer: Gradio's client reads the stream only while it thinks one is open
// (it opens one when a join is answered while none is, and lets it go at the server's close_stream, sent once the
// session has no event left). A join the server answers just after that close, a click at that moment, can reach
// the client before the close does on a busy machine: the client then waits for the event on a stream that is
// ending, and the click's outcome (its toast, its outputs) never comes. So a join's answer goes on to the client
// only once the open stream has carried a message of its event (the server sends the event's place at once) or
// that stream has ended and the client has read its end (it then opens a new one for the event). The end is read
// from the stream itself: the client's abort at close_stream is no sign, as it aborts the client's latest stream,
// which an upload's progress stream replaces.
window.cvQueue = (() => {
  const ZH = (navigator.language || "").startsWith("zh");
  const WORDS = {
    next: ["waiting: next in line", "排队中：下一个就是你"],
    place: ["waiting: {n} in line", "排队中：第 {n} 位"],
    starting: ["starting…", "即将开始…"],
    eta: ["about {s} s until its turn", "约 {s} 秒后轮到"],
  };
  const takeOf = {};  // event id -> take id
  const early = {};  // event id -> its latest message, when it came before the join's answer
  const stopped = new Set();  // takes stopped by the page: still in Gradio's queue until their handler runs
  let shown = "";  // the take whose place is on the line
  const carried = new Set();  // the latest events the stream carried a message of (a join's answer may come later)
  const waiting = new Map();  // event id -> what lets its held join answer go on
  let open = null;  // the stream the client reads: { gone } (a promise kept once the client has read its end)

  function ordinal(n) {
    const tens = n % 100, ones = n % 10;
    const suffix = tens >= 11 && tens <= 13 ? "th" : ones === 1 ? "st" : ones === 2 ? "nd" : ones === 3 ? "rd" : "th";
    return ZH ? String(n) : `${n}${suffix}`;
  }

  // the place, and on a line of its own Gradio's estimate of the wait (from the queue's recent takes), if any
  function line(text, takeId, etaSeconds = null) {
    const el = document.getElementById("queue-place");
    if (!el) return;
    el.textContent = text;
    el.hidden = !text;
    shown = text ? takeId : "";
    let eta = document.getElementById("queue-eta");
    if (!eta) {
      eta = Object.assign(document.createElement("div"), { id: "queue-eta", hidden: true });
      el.after(eta);
    }
    const known = text && Number.isFinite(etaSeconds) && etaSeconds >= 1;
    eta.textContent = known ? WORDS.eta[ZH ? 1 : 0].replace("{s}", String(Math.ceil(etaSeconds))) : "";
    eta.hidden = !known;
  }

  function clear(takeId) {
    if (takeId === shown) line("", "");
  }

  function said(message, takeId) {
    const studio = window.cvStudio;
    if (stopped.has(takeId) || !studio || studio.current() !== takeId) return clear(takeId);
    if (message.msg === "estimation" && typeof message.rank === "number") {
      const n = message.rank + 1;
      line(n === 1 ? WORDS.next[ZH ? 1 : 0] : WORDS.place[ZH ? 1 : 0].replace("{n}", ordinal(n)), takeId,
           message.rank_eta);
    } else if (message.msg === "process_starts") {
      studio.turn(takeId);
      line(WORDS.starting[ZH ? 1 : 0], takeId);
    } else if (message.msg === "process_generating" || message.msg === "process_completed") {
      clear(takeId);
    }
  }

  function heard(message) {
    const id = message && message.event_id;
    if (!id) return;
    carried.delete(id);
    carried.add(id);
    if (carried.size > 100) carried.delete(carried.values().next().value);
    if (waiting.has(id)) waiting.get(id)();
    if (takeOf[id]) said(message, takeOf[id]);
    else if (message.msg === "process_completed") delete early[id];
    else early[id] = message;
  }

  // the stream's messages, to heard(), until it ends
  async function read(body) {
    const reader = body.pipeThrough(new TextDecoderStream()).getReader();
    let rest = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return;
        const lines = (rest + value).split(/\r?\n/);
        rest = lines.pop();
        for (const text of lines) {
          if (!text.startsWith("data:")) continue;
          let message;
          try { message = JSON.parse(text.slice(5)); } catch (err) { continue; /* not a queue message */ }
          heard(message);
        }
      }
    } catch (err) { /* the stream was closed: Gradio's copy says so */ }
  }

  // a join's answer, once the stream the client reads carries its event or has ended (then the client opens a new
  // one; a stream opened meanwhile must carry the event as well)
  async function served(id) {
    while (open && !carried.has(id)) {
      const stream = open;
      await new Promise((resolve) => {
        waiting.set(id, resolve);
        stream.gone.then(resolve);
      });
      waiting.delete(id);
    }
  }

  // the stream the client reads from now on, until letGo()
  function opened() {
    let letGo;
    const stream = { gone: new Promise((resolve) => { letGo = resolve; }) };
    stream.letGo = letGo;
    stream.gone.then(() => { if (open === stream) open = null; });
    open = stream;
    return stream;
  }

  // the take a join starts, if it is one (its first input is the take id)
  function takeOfJoin(init) {
    try {
      const takeId = JSON.parse(init.body).data[0];
      return typeof takeId === "string" && window.cvStudio && window.cvStudio.takes[takeId] ? takeId : null;
    } catch (err) {
      return null;
    }
  }

  const original = window.fetch.bind(window);
  window.fetch = async (input, init) => {
    const url = typeof input === "string" ? input : input instanceof URL ? input.href : input.url;
    const path = new URL(url, window.location.href).pathname;
    if (path.endsWith("/queue/data")) {
      const stream = opened();
      let response;
      try {
        response = await original(input, init);
      } catch (err) {
        stream.letGo();
        throw err;
      }
      if (!response.ok || !response.body) {
        stream.letGo();
        return response;
      }
      const [mine, theirs] = response.body.tee();
      // the client reads its copy of the same bytes in microtasks: a task after this copy ends, it has taken in
      // the close_stream (its stream is no longer open) and opens a new stream for the answers let go
      read(mine).then(() => setTimeout(stream.letGo, 0));
      return new Response(theirs, { status: response.status, statusText: response.statusText,
                                    headers: response.headers });
    }
    const response = await original(input, init);
    if (!path.endsWith("/queue/join") || !response.ok) return response;
    const { event_id: id } = await response.clone().json().catch(() => ({}));
    if (!id) return response;
    const takeId = takeOfJoin(init);
    if (takeId) {
      takeOf[id] = takeId;
      if (early[id]) said(early[id], takeId);
      delete early[id];
    }
    await served(id);
    return response;
  };

  // Stop (or a new take) on the page: the take's place is no longer news.
  function forget(takeId) {
    stopped.add(takeId);
    clear(takeId);
  }

  return { forget };
})();

// Prompt uploads and recordings: what the browser's own checks would get wrong or leave unsaid.
(() => {
  const ZH = (navigator.language || "").startsWith("zh");
  const WORDS = {
    insecure: ["Recording needs a secure page (https:// or localhost); upload a recording instead.",
               "录音需要安全连接（https:// 或 localhost）；请改为上传录音。"],
    none: ["No microphone was found: connect one and allow it for this page, or upload a recording.",
           "未找到麦克风：请连接并允许此页面使用，或上传录音。"],
    blocked: ["The browser blocked the microphone: allow it for this page (the icon in the address bar), or "
              + "upload a recording.", "浏览器阻止了麦克风：请在地址栏的图标中允许此页面使用，或上传录音。"],
    failed: ["The microphone could not be started; upload a recording instead.", "无法启动麦克风；请改为上传录音。"],
  };

  function say(problem) {
    const prompt = document.getElementById("prompt");
    if (!prompt) return;
    let line = document.getElementById("mic-message");
    if (!line) {
      line = document.createElement("div");
      line.id = "mic-message";
      line.setAttribute("role", "alert");
      prompt.appendChild(line);
    }
    line.textContent = problem ? WORDS[problem][ZH ? 1 : 0] : "";
    line.hidden = !problem;
  }

  async function micProblem() {
    if (!window.isSecureContext || !navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) return "insecure";
    try {
      const devices = await navigator.mediaDevices.enumerateDevices();
      if (!devices.some((d) => d.kind === "audioinput")) return "none";
    } catch (err) {
      return "none";
    }
    return null;
  }

  if (navigator.mediaDevices && navigator.mediaDevices.getUserMedia) {
    const getUserMedia = navigator.mediaDevices.getUserMedia.bind(navigator.mediaDevices);
    navigator.mediaDevices.getUserMedia = async (constraints) => {
      try {
        return await getUserMedia(constraints);
      } catch (err) {
        say(err && err.name === "NotAllowedError" ? "blocked" : err && err.name === "NotFoundError" ? "none" : "failed");
        throw err;
      }
    };
  }

  // the microphone source or Record clicked: say at once why recording cannot work here
  document.addEventListener("click", async (event) => {
    const button = event.target.closest && event.target.closest("#prompt button");
    if (!button) return;
    const label = button.getAttribute("aria-label") || "";
    if (label === "Record audio" || /record|录制/i.test(button.textContent || "")) say(await micProblem());
    else if (label === "Upload file") say(null);
  }, true);

  // WebM/Opus (what browsers record) is often typed video/webm, which the upload's audio/* check refuses:
  // hand the same bytes over as audio/webm (the server decodes WebM/Opus)
  document.addEventListener("change", (event) => {
    const input = event.target;
    if (!(input instanceof HTMLInputElement) || input.type !== "file" || !input.closest("#prompt")) return;
    const files = [...(input.files || [])];
    if (!files.some((f) => f.type.startsWith("video/"))) return;
    const retyped = new DataTransfer();
    for (const f of files) {
      retyped.items.add(f.type.startsWith("video/")
        ? new File([f], f.name, { type: f.type.replace("video/", "audio/"), lastModified: f.lastModified }) : f);
    }
    input.files = retyped.files;
  }, true);
})();
