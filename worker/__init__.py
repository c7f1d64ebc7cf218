"""specfleet worker side: the llama.cpp seam, the speculative engine, the fitter, the rq worker."""
