from ondevice_moe.cli import main

main()
