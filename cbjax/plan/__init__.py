"""`cbjax plan`: what a model needs per device, and a decode roofline."""
