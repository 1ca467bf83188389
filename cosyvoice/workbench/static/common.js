// Shared by the workbench pages: JSON calls whose errors carry the server's message.
async function api(path, options) {
  const response = await fetch("/workbench/api" + path, options);
  const body = response.status === 204 ? null :
    (response.headers.get("content-type") || "").includes("json") ? await response.json() : await response.text();
  if (!response.ok) {
    const error = new Error((body && body.error && body.error.message) || response.statusText);
    error.status = response.status;
    throw error;
  }
  return body;
}
function post(path, data) {
  return api(path, {method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(data)});
}
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (v !== undefined && v !== null && v !== false) node.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}
function fmt(x, digits = 2) { return x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(digits); }
// A value as a reader expects it: counts as whole numbers, measurements to ``digits`` places, nothing as "–".
function number(x, digits = 2) {
  if (typeof x !== "number") return x ?? "–";
  return Number.isInteger(x) ? String(x) : fmt(x, digits);
}
// What went wrong, for the page: the server's message, or (no answer at all) what a fetch's "Failed to fetch" means.
function problem(e) {
  return e.status === undefined ? "The server does not answer: check that it is running, then try again." : e.message;
}
// The test kinds as the owner's pages name them
const KINDS = {ab: "A/B preference", abx: "ABX", mos: "MOS", cmos: "CMOS", mushra: "MUSHRA",
               mushra_noref: "MUSHRA without reference"};
