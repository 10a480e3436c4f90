"""GLM-4.1V / 4.5V / 4.6V (Glm4vProcessor, Glm46VProcessor)."""
