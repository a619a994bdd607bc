"""SAFE itself: byte-offset alignment of the tokenizations, UniTE / GaC aggregation with sharpening, the
decision at each drafted position, and the draft → verify → scan round every strategy shares."""
