// The rater's player of one item (rate.html), the same in every test type: one audio element per sample and one
// shared position, as webMUSHRA has it (switching samples keeps the position, so a passage is compared across
// samples), pause, a position display and a loop region (from/to, looped or not).
//
// What counts as "played to the end": one play that starts at 0 s with no region set and reaches the sample's end
// without a jump. Pausing and resuming keep it going; a switch to another sample, a region or a jump back to the
// start leave it uncounted. Such a play posts "play" before its sound starts (the reply is awaited, so the server's
// clock never starts late) and "ended" at its end, and the server accepts an answer only where every sample has an
// end at least the sample's length after its start, on its own clock.
const AT_START = 0.05;  // seconds: a play starting this close to 0 starts at the start

class Player {
  /** ``url(slot)``: a sample's audio; ``region()``: {from, to, loop}; ``display``, ``nowPlaying``: the elements of
   * the position and of the current sample's name; ``onEvent(slot, name)``: posts a play/ended event (a promise);
   * ``onPlayed(slot)``: the server has a whole play; ``onError(message)``: the browser refused to play. */
  constructor(options) {
    this.options = options;
    this.samples = new Map();
    this.current = null;
    this.position = 0;  // seconds: where the next sample switched to starts
  }

  /** A sample's box: its name, a Play/Pause button, a progress bar and its state. */
  add(slot, label, played) {
    const audio = new Audio();
    // the whole sample in memory: seekable (the blind audio route serves no ranges) and fetched once
    const ready = fetch(this.options.url(slot)).then(r => {
      if (!r.ok) throw new Error(`${label}: ${r.statusText}`);
      return r.blob();
    }).then(blob => { audio.src = URL.createObjectURL(blob); });
    ready.catch(e => this.options.onError(e.message));  // shown at once, not only when the rater presses Play
    const bar = el("div");
    const state = el("div", {class: "state"}, played ? "✓ played to the end" : "not played yet");
    const button = el("button", {class: "play", "data-slot": slot, onclick: () => this.toggle(slot)}, "▶ Play");
    const box = el("div", {class: played ? "slot played" : "slot", "data-slot": slot},
                   el("b", {}, label), button, el("div", {class: "bar"}, bar), state);
    const sample = {slot, label, audio, ready, bar, state, button, box, whole: false, played};
    this.samples.set(slot, sample);
    audio.addEventListener("play", () => this.started(sample));
    audio.addEventListener("pause", () => this.paused(sample));
    audio.addEventListener("timeupdate", () => this.tick(sample));
    audio.addEventListener("ended", () => this.ended(sample));
    return box;
  }

  /** Play or pause ``slot`` (null: the current sample, else the first); switching hands over the position. */
  async toggle(slot) {
    const sample = this.samples.get(slot ?? this.current) || this.samples.values().next().value;
    if (!sample) return;
    try { await sample.ready; } catch (e) { this.options.onError(e.message); return; }
    if (sample.slot === this.current && !sample.audio.paused) {
      sample.audio.pause();
      return;
    }
    if (sample.slot !== this.current) {
      const before = this.samples.get(this.current);
      if (before) {
        this.position = before.audio.currentTime;
        before.whole = false;
        before.audio.pause();
      }
      this.current = sample.slot;
      sample.audio.currentTime = this.clamp(sample, this.position);
    }
    await this.start(sample);
  }

  /** Play from where the sample stands; from 0 with no region set, that play is one that may count. */
  async start(sample) {
    const {from, to} = this.options.region();
    const at = sample.audio.ended ? 0 : sample.audio.currentTime;
    if (!sample.whole && at < AT_START && from === 0 && to === null) {
      sample.whole = true;
      await this.options.onEvent(sample.slot, "play");
    }
    sample.audio.play().catch(e => this.options.onError(e.message));
  }

  /** Back to the region's start (or 0); a play from 0 then counts again. */
  rewind() {
    const sample = this.samples.get(this.current);
    if (!sample) return;
    const playing = !sample.audio.paused;
    sample.audio.pause();
    sample.whole = false;
    sample.audio.currentTime = this.position = this.options.region().from;
    this.show();
    if (playing) this.start(sample);
  }

  /** Stop every sample and let their audio go (the next item has its own player). */
  stop() {
    for (const sample of this.samples.values()) {
      sample.audio.pause();
      sample.ready.then(() => URL.revokeObjectURL(sample.audio.src), () => {});
    }
  }

  /** ``at`` inside the region and the sample (a position past either starts at the region's start). */
  clamp(sample, at) {
    const {from, to} = this.options.region();
    const end = Number.isFinite(sample.audio.duration) ? sample.audio.duration - AT_START : Infinity;
    return at < from || (to !== null && at >= to) || at >= end ? from : at;
  }

  started(sample) {
    sample.button.textContent = "❚❚ Pause";
    sample.state.textContent = sample.whole ? "playing…" : "playing a segment…";
    this.show();
  }

  paused(sample) {
    sample.button.textContent = "▶ Play";
    if (!sample.audio.ended) sample.state.textContent = "paused";
    this.show();
  }

  tick(sample) {
    const audio = sample.audio;
    sample.bar.style.width = `${100 * audio.currentTime / (audio.duration || 1)}%`;
    const {from, to, loop} = this.options.region();
    if (to !== null && audio.currentTime >= to) {
      sample.whole = false;
      if (loop) audio.currentTime = from; else audio.pause();
    }
    this.show();
  }

  async ended(sample) {
    const {from, loop} = this.options.region();
    this.position = from;
    const counted = sample.whole;
    sample.whole = false;
    if (counted) {  // its end reaches the server before a looped sample's next start
      await this.options.onEvent(sample.slot, "ended");
      sample.played = true;
      sample.box.classList.add("played");
      this.options.onPlayed(sample.slot);
    }
    if (loop) {
      sample.audio.currentTime = from;
      this.start(sample);
    } else {
      sample.state.textContent = sample.played ? "✓ played to the end" : "not played yet";
    }
  }

  /** The current sample's name and position, "1.25 / 3.00 s". */
  show() {
    const sample = this.samples.get(this.current);
    if (!sample) return;
    const audio = sample.audio;
    this.options.display.textContent = `${audio.currentTime.toFixed(2)} / ${(audio.duration || 0).toFixed(2)} s`;
    this.options.nowPlaying.textContent = sample.label;
  }
}
