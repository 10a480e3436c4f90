"""MiniCPM-V 4.6 (MiniCPMV4_6Processor + MiniCPMV4_6ImageProcessorPil, MiniCPMV4_6ForConditionalGeneration)."""
