// CosyVoice3 Studio live player: reads a take's PCM16 chunks (WebSocket studio/live/<id>) and schedules each
// piece on an AudioContext right after the previous one, so playback starts with the first chunk and has no
// gaps unless the audio arrives later than it plays. window.cvStudio.takes keeps each take's timings
// (epoch milliseconds) for the page's status line and the browser tests.
window.cvStudio = (() => {
  const ZH = (navigator.language || "").startsWith("zh");
  const LEAD_S = 0.02; // scheduling margin for the first piece and after a stall
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
    const label = el.querySelector(".live-text");
    if (label) label.textContent = text;
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
      show("playing", ZH ? "正在播放" : "playing");
    }
    take.next += buffer.duration;
    take.samples += samples.length;
    take.sources.push(source);
    source.onended = () => {
      if (take.streamDone && source === take.sources[take.sources.length - 1]) finish(take, "done");
    };
  }

  function finish(take, state) {
    if (take.endAt !== null) return;
    take.endAt = now();
    take.state = state;
    const words = { done: ["", ""], stopped: ["stopped", "已停止"], failed: ["playback failed", "播放失败"] };
    if (current === take) show(state === "done" ? "idle" : state, (words[state] || ["", ""])[ZH ? 1 : 0]);
  }

  function run(take) {
    const url = new URL(`${base()}/studio/live/${take.id}`, window.location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(url);
    socket.binaryType = "arraybuffer";
    take.socket = socket;
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
      if (event.code !== 1000) return finish(take, "failed");
      take.streamDone = true;
      if (!take.sources.length || ctx.currentTime >= take.next) finish(take, "done");
    };
  }

  return {
    takes,
    // A new take: called on the Generate click (a user gesture, so the AudioContext may start).
    begin(rate) {
      this.stop();
      const id = crypto.randomUUID();
      const take = {
        id, rate, clickAt: now(), firstByteAt: null, firstSoundAt: null, endAt: null, state: "waiting",
        stalls: 0, gapsMs: [], samples: 0, next: 0, sources: [], streamDone: false, stopped: false,
        socket: null,
      };
      takes[id] = take;
      current = take;
      context(rate);
      show("waiting", ZH ? "生成中…" : "generating…");
      run(take);
      return id;
    },
    // Stop the current take's playback; returns its id (the server stops it too), "" when there is none.
    stop() {
      const take = current;
      if (!take) return "";
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
    summary(id) {
      const t = takes[id];
      if (!t) return null;
      const { socket, sources, ...plain } = t;
      return plain;
    },
  };
})();
