int kvb_cmd_bench(int argc, char **argv){(void)argc;(void)argv;return 1;}
