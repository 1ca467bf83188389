// CosyVoice3 Studio live player: reads a take's PCM16 stream (GET studio/live/<id>) and schedules each
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

  async function run(take) {
    let carry = null;
    try {
      const response = await fetch(`${base()}/studio/live/${take.id}`, { cache: "no-store", signal: take.abort.signal });
      take.rate = Number(response.headers.get("X-Sample-Rate")) || take.rate;
      const reader = response.body.getReader();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        if (take.firstByteAt === null) take.firstByteAt = now();
        let bytes = value;
        if (carry !== null) {
          bytes = new Uint8Array(carry.length + value.length);
          bytes.set(carry);
          bytes.set(value, carry.length);
          carry = null;
        }
        const even = bytes.length - (bytes.length % 2);
        if (bytes.length > even) carry = bytes.slice(even);
        if (even) schedule(take, new Int16Array(bytes.buffer.slice(bytes.byteOffset, bytes.byteOffset + even)));
      }
      take.streamDone = true;
      if (!take.sources.length || ctx.currentTime >= take.next) finish(take, "done");
    } catch (err) {
      finish(take, take.stopped ? "stopped" : "failed");
    }
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
        abort: new AbortController(),
      };
      takes[id] = take;
      current = take;
      context(rate);
      show("waiting", ZH ? "生成中…" : "generating…");
      run(take);
      return id;
    },
    stop() {
      const take = current;
      if (!take || take.endAt !== null) return;
      take.stopped = true;
      take.abort.abort();
      for (const source of take.sources) {
        try { source.stop(); } catch (err) { /* not started yet */ }
      }
      finish(take, "stopped");
    },
    summary(id) {
      const t = takes[id];
      if (!t) return null;
      const { abort, sources, ...plain } = t;
      return plain;
    },
  };
})();
