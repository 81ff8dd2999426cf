"""The instructor's and CI's tools: the ``gpulab`` command line (``cli``), running the course (``course``),
recording reference results and the GPU verification (``record``, ``verify*``), ``gpulab bench`` (``bench``,
``timer_agreement``), the claims table, notebook upkeep and the offline wheelhouse."""
