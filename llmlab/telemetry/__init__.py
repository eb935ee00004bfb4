"""Telemetry: what the GPU says while the model decodes, live or recorded.

    nvml_sampler.py  a background NVML sampler: GPU-Util, memory, power, clocks, and GPM's SM activity and DRAM bandwidth
    record.py        llmlab record: decode while sampling and write a trace per setting
    trace.py         the trace file format, and replaying a recorded trace
    dashboard.py     the live ipywidgets + plotly dashboard of the labs: its widgets and how a run is driven
    controls.py      the dashboard's controls, and the lines saying what this machine cannot run or show
    live_run.py      one dashboard run: its state, the worker thread that decodes, its row in the table of runs
    figures.py       the plotly figures: the dashboard's panels and bars, and static figures of a recorded trace
"""
