"""Front ends around the cosyvoice engine: the Gradio web UI (:mod:`app.ui`)."""
