set terminal pngcairo size 900,540 noenhanced
set datafile commentschars '#'
set output 'docs/img/throughput.png'
set title 'Throughput vs devices (cnn, global batch 256, cpu)'
set xlabel 'devices'
set ylabel 'samples/s'
set xtics 1
set grid
set key left top
set yrange [0:*]
plot 'docs/img/throughput.dat' using 1:2 with linespoints lw 2 pt 7 title 'DP', '' using 1:3 with linespoints lw 2 pt 5 title 'DDP', '' using 1:4 with lines dt 2 lw 2 title 'single device (no wrapper)'
set output 'docs/img/phases.png'
set title 'Per-step phases on device 0, critical path (cnn, global batch 256, cpu)'
unset xlabel
set ylabel 'ms per step'
set xtics rotate by -30
set key outside right
set style data histograms
set style histogram rowstacked
set style fill solid 0.85 border -1
set boxwidth 0.7
plot for [i=2:9] 'docs/img/phases.dat' using i:xtic(1) title columnheader(i)
