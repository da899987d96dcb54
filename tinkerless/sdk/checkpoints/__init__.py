"""A saved policy, from the client: naming it (`checkpoint_ref`: `RUN@STEP`, `RUN@latest`, `base`), exporting it
as a PEFT adapter or merged weights (`export`), and starting a new run from it (`warm_start`)."""
